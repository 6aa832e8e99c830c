"""--plot (memplan/plot.py): the pictures are drawn and hold what they claim; the terminal bar's arithmetic."""

from __future__ import annotations

import struct
import sys

import pytest
from test_bad_inputs import run_cli

pytest.importorskip("matplotlib")


def test_estimate_plot_svg_across_gpu_counts(tmp_path):
    out = tmp_path / "bars.svg"
    code, text, err = run_cli(f"estimate llama-3-8b --gpus 8 --stage 3 --gpu h100-80g --plot {out}".split())
    assert code == 0, err
    svg = out.read_text()
    assert out.stat().st_size > 10_000 and svg.lstrip().startswith("<?xml")
    for label in ("optimizer states", "activations", "allocator, CUDA context, NCCL", "GPU 79.18 GiB",
                  "8 (this job)", "GPUs"):
        assert label in svg, label


def test_plan_plot_png_across_candidates(tmp_path):
    out = tmp_path / "plan.png"
    code, _, err = run_cli(f"plan llama-7b --gpu a100-40g --strategies zero2,zero3,fsdp-full --plot {out}".split())
    assert code == 0, err
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # IHDR: matplotlib's 100 dpi x the figure's inches
    assert (width, height) == (840, 450)  # 3 strategies x 2 recomputes: max(6, 0.9 x 6 + 3) x 4.5 inches


@pytest.mark.parametrize("name", ["bars.pdf", "bars"])
def test_plot_needs_svg_or_png(tmp_path, name):
    out = tmp_path / name
    code, text, err = run_cli(["estimate", "gpt2", "--plot", str(out)])
    assert code == 2 and "must end in .svg or .png" in err and err.count("\n") == 1 and not out.exists()


def test_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, text, err = run_cli(["estimate", "gpt2", "--plot", str(tmp_path / "x.svg")])
    assert code == 2 and "pip install 'memplan[plot]'" in err


def test_terminal_bar():
    # each cell a width-th of the GPU (or of the job when it is larger), segments rounded at their running sums
    from memplan.plot import terminal_bar

    seg = {"weights_bytes": 10, "optimizer_states_bytes": 20, "activations_bytes": 10, "overhead_bytes": 4}
    assert terminal_bar(seg, 80, width=20) == "WWOOOOOOAA+·········"
    assert terminal_bar(seg, 40, width=20) == "WWWWWOOOOOOOOOAAAA|++"  # 44 on a 40 card: '|' at 18 cells
    assert terminal_bar(seg, None, width=22) == "WWWWWOOOOOOOOOOAAAAA++"
