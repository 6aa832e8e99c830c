"""Golden plans: the engine's answers for the shipped presets and for every measured case, byte for byte.

A change meant to move code, not numbers, must leave these identical. A change that means to move numbers
regenerates them (`python tools/golden_plans.py`, `python tools/golden_plans.py --accuracy`) in the same commit
and says why in its message. The quick suite checks two presets (tied embeddings; MoE with GQA); the slow suite
checks every preset and the measured cases (which trace small models).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import golden_plans  # noqa: E402


def _differences(got: dict, want: dict) -> list[str]:
    return [k for k in want if k in got and got[k] != want[k]]


@pytest.mark.parametrize("preset", ["gpt2", pytest.param("mixtral-8x7b", marks=pytest.mark.slow)])  # (with -m slow: the quick suite's 15-minute budget on 2 cores)
def test_golden_plans_quick(preset):
    want = {k: v for k, v in golden_plans.load().items() if k.startswith(preset + "|")}
    got = golden_plans.compute([preset])
    assert set(got) == set(want)
    assert _differences(got, want) == []


@pytest.mark.slow
def test_golden_plans_every_preset():
    want = golden_plans.load()
    got = golden_plans.compute()
    assert set(got) == set(want)
    assert _differences(got, want) == []


@pytest.mark.slow
def test_golden_accuracy_predictions_of_the_cpu_cases():
    # the CPU cases (bench/accuracy.py), which need nothing outside the repository: every one, none differing
    want = {k: v for k, v in golden_plans.load(golden_plans.GOLDEN_ACCURACY).items() if k.startswith("cpu|")}
    got = golden_plans.accuracy_predictions(gpu=False)
    assert set(got) == set(want)
    assert _differences(got, want) == []


@pytest.mark.slow
def test_golden_accuracy_predictions_of_the_gpu_cases():
    # the GPU cases (../shared/gpu/truth.jsonl and bench/gpu/truth-extra.jsonl) read their configs from ../shared,
    # outside the repository: without it they are skipped, by name, rather than left out of the comparison
    shared = ROOT.parent / "shared" / "gpu"
    if not (shared / "truth.jsonl").is_file():
        pytest.skip(f"{shared / 'truth.jsonl'} is not here: the GPU cases cannot be predicted")
    want = golden_plans.load(golden_plans.GOLDEN_ACCURACY)
    got = golden_plans.accuracy_predictions(shared)
    assert set(got) == set(want)
    assert _differences(got, want) == []
