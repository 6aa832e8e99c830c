"""The user's own nn.Module end to end (issue 20 item 0): a factory ``pkg.module:callable`` is counted, traced
(forward and backward under FakeTensorMode, as transformers' models are), split into its blocks (the FSDP / ZeRO-3
units) and estimated under every strategy: a hand-written GPT, a torchvision-style CNN with an input builder and
a mixture-of-experts model without transformers (tests/data/user_modules)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bad_inputs import run_cli

MODULES = Path(__file__).resolve().parents[1] / "data" / "user_modules"


@pytest.fixture(autouse=True)
def _path(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(MODULES))
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path / "cache"))


def _estimate(args: str) -> dict:
    code, out, err = run_cli(args.split() + ["--json"])
    assert code in (0, 1), err
    return json.loads(out)


@pytest.mark.parametrize("factory", ["tiny_gpt:make", pytest.param("tiny_cnn:make", marks=pytest.mark.slow),
                                     pytest.param("tiny_moe:make", marks=pytest.mark.slow)])  # (with -m slow: the quick suite's 15-minute budget on 2 cores)
def test_every_strategy_estimates_a_user_module_from_its_trace(factory):
    for strategy in ("ddp", "zero2", "zero3", "fsdp-full"):
        rep = _estimate(f"estimate {factory} --gpus 2 --strategy {strategy} --seq-len 64 --micro-batch 4 --explain")
        assert rep["assumptions"]["activations"].startswith("traced ("), rep["assumptions"]
        ex = rep["explain"]
        assert sum(i["bytes"] for i in ex["items"]) == rep["per_gpu"]["peak_bytes"] > 0
        if ex["activations_bytes"] and ex["phase"] in ("forward", "backward-start", "backward"):
            assert ex["traced"]


def test_the_blocks_are_the_units_and_recompute_keeps_their_inputs():
    rep = _estimate("estimate tiny_gpt:make --gpus 2 --strategy fsdp-full --seq-len 64")
    # the largest gathered unit is one Block: 4 linears and 2 norms of width 128
    d = 128
    block = (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
    assert rep["assumptions"]["largest_gathered_block_numel"] == block
    none = _estimate("estimate tiny_gpt:make --gpus 1 --seq-len 256 --explain")
    full = _estimate("estimate tiny_gpt:make --gpus 1 --seq-len 256 --recompute full --explain")
    fwd = {p["name"]: p["activations_bytes"] for p in none["phases"]}["forward"]
    fwd_full = {p["name"]: p["activations_bytes"] for p in full["phases"]}["forward"]
    assert fwd_full < fwd
    modules = {i.get("module") for i in none["explain"]["items"]}
    assert "blocks.*.fc1" in modules or any(str(m).startswith("blocks.*") for m in modules)


def test_the_cnn_takes_its_input_builder_and_a_classifier_loss():
    rep = _estimate("estimate tiny_cnn:make --gpus 1 --micro-batch 8 --explain")
    ex = rep["explain"]
    saved: dict[tuple, int] = {}
    for i in ex["items"]:
        if "saved for backward" in i.get("detail", ""):
            saved[i["module"], i["op"]] = saved.get((i["module"], i["op"]), 0) + i["bytes"]
    # what ATen saves for backward (tools/autograd/derivatives.yaml), under autocast(bf16) on a GPU, every storage
    # in 512-byte blocks; the batch is 8 images of 3 x 32 x 32 and every feature map is 8 x 32 x 32 x 32 in bf16:
    fmap = 8 * 32 * 32 * 32 * 2
    assert saved[("stages.*", "relu")] == 3 * 2 * fmap  # relu: its result, twice a stage
    assert saved[("stages.*.conv1", "convolution")] == saved[("stages.*.conv2", "convolution")] == 3 * fmap  # bn's input
    assert saved[("stem", "convolution")] == fmap  # the first stage's conv1 input
    assert saved[("stages.*.conv1", "_to_copy")] == 3 * 32 * 32 * 3 * 3 * 2  # convolution: its weight's bf16 cast
    assert saved[("stem", "_to_copy")] == 8 * 3 * 32 * 32 * 2 + 2048  # the images' cast, the 1,728 B weight cast
    assert saved[("stages.*.bn1", "native_batch_norm")] == 3 * 2 * 512  # save_mean, save_invstd: 32 floats each
    assert sum(saved.values()) == 6_983_680


def test_a_module_whose_inputs_cannot_be_guessed_is_one_line():
    code, out, err = run_cli(["estimate", "tiny_cnn:make_without_inputs", "--gpus", "1"])
    assert code == 2 and "cannot guess this model's inputs" in err and err.count("\n") == 1


def test_an_edit_to_the_module_traces_again(tmp_path, monkeypatch):
    from memplan.model import sources

    src_dir = tmp_path / "mods"
    src_dir.mkdir()
    (src_dir / "mine.py").write_text((MODULES / "tiny_gpt.py").read_text())
    monkeypatch.syspath_prepend(str(src_dir))
    s = sources.resolve("mine:make")
    inv = sources.build_inventory(s)
    first = sources.trace_config(s, inv)
    (src_dir / "mine.py").write_text((MODULES / "tiny_gpt.py").read_text() + "\n# edited\n")
    second = sources.trace_config(s, inv)
    assert first["factory_source_sha256"] != second["factory_source_sha256"]
    assert first["num_hidden_layers"] == 3 and first["factory"] == "mine:make"
