"""The accuracy the plan's headroom line quotes is the one docs/accuracy-gpu.md records (bench/gpu_accuracy.py)."""

from __future__ import annotations

import re
from pathlib import Path

from memplan.cli_render import GPU_RESERVED

DOC = Path(__file__).resolve().parents[2] / "docs" / "accuracy-gpu.md"


def test_the_quoted_reserved_accuracy_is_the_documented_one() -> None:
    line = next(ln for ln in DOC.read_text().splitlines() if ln.startswith("**reserved peak, replayed ("))
    cases = int(re.search(r"replayed \((\d+) cases", line).group(1))
    within = int(re.search(r"median \|error\| [-+]?\d+\.\d+%, within 3%: (\d+);", line).group(1))
    verdict_min = float(re.search(r"the verdict's figure [^:]*: min ([-+]?\d+\.\d+)%", line).group(1))
    assert GPU_RESERVED == {"cases": cases, "within_3": within, "verdict_min_percent": verdict_min}
