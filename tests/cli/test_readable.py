"""Output a person reads (issue 21): assumptions by topic with their sources, a status line while tracing that is
silent without a terminal and with --json, and plan's --min-headroom."""

from __future__ import annotations

import io
import json

from test_bad_inputs import run_cli


def test_assumptions_are_grouped_by_topic_with_their_sources():
    code, out, _ = run_cli("estimate llama-3-8b --gpus 8 --stage 3 --reduce-bucket-size 100000000".split())
    assert code == 0
    lines = out[out.index("assumptions"):].splitlines()
    topics = [ln.split()[0] for ln in lines[1:5]]
    assert topics == ["framework", "precision", "kernels", "overheads"]
    framework = lines[1]
    assert "reduce bucket size 100,000,000 (command line)" in framework
    assert "prefetch bucket size 50,000,000 (default)" in framework
    assert "{" not in out[out.index("assumptions"):]  # no raw Python dicts (the JSON keeps the machine form)
    # the JSON keeps every key, machine-readable
    code, js, _ = run_cli("estimate llama-3-8b --gpus 8 --stage 3 --json".split())
    assert isinstance(json.loads(js)["assumptions"]["zero3_gathered_numel"], dict)


def test_knobs_of_other_strategies_are_not_listed():
    _, out, _ = run_cli("estimate llama-3-8b --gpus 1".split())
    framework = next(ln for ln in out.splitlines() if ln.strip().startswith("framework"))
    assert "bucket cap" not in framework and "fsdp version" not in framework
    _, out, _ = run_cli("estimate llama-3-8b --gpus 8 --strategy ddp".split())
    framework = next(ln for ln in out.splitlines() if ln.strip().startswith("framework"))
    assert "bucket cap mb 25 MiB (default)" in framework


def test_progress_is_silent_without_a_terminal(tmp_path, monkeypatch):
    # a new trace (an empty cache) under the CLI: stderr is not a terminal here, so nothing but the result
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    code, out, err = run_cli("estimate gpt2 --seq-len 96 --json".split())
    assert code == 0 and err == "" and json.loads(out)["per_gpu"]["peak_bytes"] > 0


def test_progress_line_shows_the_trace_steps(tmp_path, monkeypatch):
    from rich.console import Console

    from memplan import progress
    from memplan.activations.profile_cache import load_or_trace
    from memplan.activations.tracing.fit import traced_steps

    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    buf = io.StringIO()
    progress.enable(True, Console(file=buf, force_terminal=True, width=200))
    try:
        cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 2, "n_layer": 2,
               "n_positions": 64, "vocab_size": 128}
        load_or_trace(cfg, seq_len=32, micro_batch=1, recipe="torch-amp", attention="flash", recompute="none")
    finally:
        progress.enable(False)
    text = buf.getvalue()
    assert "tracing gpt2's activations at seq 32" in text and f"{traced_steps(cfg)}/{traced_steps(cfg)}" in text
    assert traced_steps(cfg) == 4 and traced_steps({"num_hidden_layers": 1}) == 2


def test_plan_min_headroom_leaves_that_much_free():
    _, out, _ = run_cli("plan llama-7b --gpu h100-80g --json".split())
    base = json.loads(out)
    _, out, _ = run_cli("plan llama-7b --gpu h100-80g --min-headroom 20GiB --json".split())
    rep = json.loads(out)
    assert rep["search"]["min_headroom_bytes"] == 20 * 2**30 and base["search"]["min_headroom_bytes"] == 0
    assert rep["recommendation"]["headroom_bytes"] >= 20 * 2**30
    for c in rep["candidates"]:
        at = c["at_recommended_gpus"]
        if at is not None:
            assert at["headroom_bytes"] >= 20 * 2**30, c
    # a fraction of the GPU
    _, out, _ = run_cli("plan llama-7b --gpu h100-80g --min-headroom 0.25 --json".split())
    rep = json.loads(out)
    assert rep["search"]["min_headroom_bytes"] == int(0.25 * rep["search"]["gpu_memory_bytes"])
    assert rep["recommendation"]["headroom_bytes"] >= rep["search"]["min_headroom_bytes"]


def test_plan_says_what_the_headroom_rests_on_and_what_was_not_tried():
    code, out, _ = run_cli("plan llama-7b --gpu h100-80g".split())
    assert code == 0 and "replayed" in out and "--min-headroom" in out
    code, out, _ = run_cli("plan llama-70b --gpu h100-80g --max-gpus 8".split())
    nothing = " ".join(out[out.index("NOTHING FITS"):].split())
    # full recompute was in the search: not suggested again
    assert code == 1 and "--allow-offload" in nothing and "--recompute" not in nothing


def test_estimate_explain_in_the_table_and_the_json():
    code, out, _ = run_cli("estimate llama-3-8b --gpus 8 --stage 2 --explain".split())
    assert code == 0 and "What the peak holds" in out and "model.layers.*" in out
    code, out, _ = run_cli("estimate llama-3-8b --gpus 8 --stage 2".split())
    assert "peak in backward" in out and "What the peak holds" not in out
    code, out, _ = run_cli("estimate llama-3-8b --gpus 8 --stage 2 --explain --json".split())
    ex = json.loads(out)["explain"]
    assert ex["traced"] and ex["peak_bytes"] == json.loads(out)["per_gpu"]["peak_bytes"]
    assert "explain" not in json.loads(run_cli("estimate llama-3-8b --gpus 8 --stage 2 --json".split())[1])
