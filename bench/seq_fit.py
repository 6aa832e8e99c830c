"""How close a profile fitted at an untraced sequence length (memplan/activations/profile_fit.py, from the shipped lengths) is
to a trace at that length: every value the engine reads off a profile (its terms, named moments, block moments
and the head's backward) at micro-batch 1, 2, 4 and 8, for each preset at lengths that are not shipped.

    python bench/seq_fit.py [--out docs/accuracy-seqfit.md]

Writes the markdown table (with this command) to --out. Traces on the CPU for the H100 kernel class (sm90), as the
shipped profiles are made.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memplan.activations import profile_cache  # noqa: E402
from memplan.activations.kernels import Target  # noqa: E402
from memplan.model import sources  # noqa: E402
from memplan.activations.profile_fit import engine_values, fit_seqs  # noqa: E402
from memplan.activations.tracing import trace_profile  # noqa: E402

LENGTHS = (700, 1500, 3000, 6000, 20000, 100000)
TARGET = Target(device="cuda", arch="sm90")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "accuracy-seqfit.md"))
    ap.add_argument("--presets", nargs="*")
    args = ap.parse_args()
    rows, worst_over, worst_under, n = [], 0.0, 0.0, 0
    for name in args.presets or sources.preset_names():
        cfg = sources.resolve(name).config
        longest = fit_seqs(cfg)[-1]
        for recompute in ("none", "full"):
            for s in LENGTHS:
                if s > longest:
                    continue
                t0 = time.perf_counter()
                fitted = profile_cache.load_or_trace(cfg, seq_len=s, micro_batch=1, recipe="deepspeed-bf16",
                                                     attention="flash", recompute=recompute, allow_trace=False,
                                                     target=TARGET)
                fit_s = time.perf_counter() - t0
                if fitted is None:
                    rows.append(f"| {name} | {recompute} | {s} | not fitted (traces) | | | |")
                    continue
                direct = trace_profile(cfg, seq_len=s, recipe="deepspeed-bf16", attention="flash",
                                       recompute=recompute, target=TARGET)
                errs = []
                for b in (1, 2, 4, 8):
                    pairs = zip(engine_values(fitted.data, recompute, b), engine_values(direct, recompute, b))
                    for f, d in pairs:
                        if d:
                            errs.append((f - d) / d)
                lo, hi = min(errs), max(errs)
                worst_over, worst_under, n = max(worst_over, hi), min(worst_under, lo), n + 1
                rows.append(f"| {name} | {recompute} | {s} | {', '.join(map(str, fitted.data['fitted_from']))} | "
                            f"{100 * lo:+.4f}% | {100 * hi:+.4f}% | {1000 * fit_s:.0f} ms |")
                print(rows[-1], flush=True)
    head = (f"# Profiles fitted at untraced sequence lengths\n\nMade by `python bench/seq_fit.py` (CPU; traces for "
            "the H100 kernel class, sm90, recipe deepspeed-bf16, as shipped). For each preset, recompute setting and "
            "a length that is not shipped, the profile fitted from the shipped lengths (memplan/activations/profile_fit.py) "
            "against a trace at that length: every value the engine reads off a profile (terms, named moments, "
            "block moments, the head's backward) at micro-batch 1, 2, 4 and 8, as (fitted - traced) / traced. The "
            "fit is exact at shipped lengths; elsewhere it rounds each point up by one 512-byte allocator block per "
            "storage alive, so it is never below the trace. The last column is wall time in this process (other "
            "work may share the cores); a fit is kept in the cache, so only the first estimate at a length pays it "
            "(docs/performance.md). Lengths past a model's maximum are skipped; a model with a sliding window "
            "(mistral-7b: 4,096 tokens) is fitted from lengths on one side of it (its traces run other operations "
            "from the window on).\n\n"
            f"**{n} fits; lowest {100 * worst_under:+.4f}%, highest {100 * worst_over:+.4f}%**\n\n"
            "| preset | recompute | seq | fitted from | lowest | highest | fit (load + fit) |\n"
            "|---|---|---:|---|---:|---:|---:|\n")
    Path(args.out).write_text(head + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
