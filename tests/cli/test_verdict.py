"""The fit verdict is the caching allocator's own (issue 42): the step replayed under the card's limits, flushing the
cache and retrying as PyTorch does before it raises out of memory; a per_process_memory_fraction caps it, whether
it comes from --allocator-conf or the environment; plan, check and the suggestions take the same verdict."""

from __future__ import annotations

import json

import pytest
from test_bad_inputs import run_cli

JOB = ["estimate", "llama-7b", "--gpus", "8", "--stage", "3", "--gpu", "h100-80g", "--json"]


def _estimate(*extra: str) -> tuple[int, dict]:
    code, out, err = run_cli(JOB + list(extra))
    assert code in (0, 1), err
    return code, json.loads(out)


def test_a_memory_fraction_moves_the_verdict(monkeypatch):
    code, rep = _estimate()
    assert code == 0 and rep["fits"] and rep["per_gpu"]["capped"]["flushes"] == 0
    assert rep["per_gpu"]["required_bytes"] == rep["per_gpu"]["uncapped_required_bytes"]
    # 5% of the card: the allocator may hold 4,250,874,675 B, the step needs far more: out of memory
    code, small = _estimate("--allocator-conf", "per_process_memory_fraction:0.05")
    cap = small["per_gpu"]["capped"]
    assert code == 1 and small["fits"] is False and cap["fits"] is False
    assert cap["fraction_limit_bytes"] == int(0.05 * 85017493504) == cap["limit_bytes"]
    assert cap["failed_request_bytes"] > 0 and small["headroom_bytes"] < 0
    # the same setting from the environment the job inherits
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "per_process_memory_fraction:0.05")
    code, env = _estimate()
    assert code == 1 and env["per_gpu"]["capped"] == cap
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    # 40%: 34,006,997,401 B, below the uncapped reserved peak (38,073,794,560 B), reached with two flushes while it
    # sets up and warms up (none in the steady step): it fits
    code, mid = _estimate("--allocator-conf", "per_process_memory_fraction:0.4")
    cap = mid["per_gpu"]["capped"]
    assert code == 0 and mid["fits"] and cap["fits"] and (cap["flushes"], cap["flushes_per_step"]) == (2, 0)
    assert cap["reserved_peak_bytes"] == 32_803_651_584 < cap["limit_bytes"] == 34_006_997_401
    assert mid["per_gpu"]["reserved_peak_bytes"] == 38_073_794_560 > cap["limit_bytes"]
    assert mid["headroom_bytes"] == cap["limit_bytes"] - cap["reserved_peak_bytes"]


def test_check_fails_a_job_the_fraction_does_not_hold():
    code, out, err = run_cli(["check", "llama-7b", "--gpus", "8", "--stage", "3", "--gpu", "h100-80g",
                              "--allocator-conf", "per_process_memory_fraction:0.05"])
    assert code == 1 and out.startswith("FAIL"), (out, err)


def test_a_job_that_only_fits_after_cache_flushes_fits_and_says_so():
    # llama-70b under ZeRO-3 on 16 H100s with full recompute: uncapped the replay reserves past the card, but
    # flushing the cache (as PyTorch does before it gives up) keeps it within the 77.68 GiB the allocator can hold
    code, out, err = run_cli(["estimate", "llama-70b", "--gpus", "16", "--strategy", "zero3", "--recompute", "full",
                              "--gpu", "h100-80g", "--no-suggestions"])
    assert code == 0, err
    assert "cache flush" in out and "FITS" in out
    code, rep = 0, json.loads(run_cli(["estimate", "llama-70b", "--gpus", "16", "--strategy", "zero3", "--recompute",
                                       "full", "--gpu", "h100-80g", "--json", "--no-suggestions"])[1])
    cap = rep["per_gpu"]["capped"]
    assert cap["fits"] and cap["flushes"] >= 1
    assert rep["per_gpu"]["uncapped_required_bytes"] > rep["cluster"]["gpu_memory_bytes"] >= \
        rep["per_gpu"]["required_bytes"] >= rep["per_gpu"]["peak_bytes"]


@pytest.mark.parametrize("fraction", ["0.3", "0.4", "0.5", "1.0"])
def test_the_plan_row_reproduces_under_a_fraction(fraction):
    # plan and estimate take the same verdict: the recommendation's command gives its bytes and its verdict
    code, out, err = run_cli(["plan", "llama-7b", "--gpu", "h100-80g", "--allocator-conf",
                              f"per_process_memory_fraction:{fraction}", "--max-gpus", "8", "--json"])
    assert code in (0, 1), err
    rep = json.loads(out)
    rec = rep["recommendation"]
    if rec is None:
        return
    args = rec["command"].split()[1:] + ["--allocator-conf", f"per_process_memory_fraction:{fraction}", "--json"]
    code, again, err = run_cli(args)
    again = json.loads(again)
    assert again["per_gpu"]["required_bytes"] == rec["required_bytes"] and again["fits"] is True


def test_the_ddp_bucket_cap_reaches_the_replay():
    # DDP's rebuilt buckets: a 1 MiB first bucket while bucket_cap_mb is its default, every bucket the cap once one
    # is given (torch/nn/parallel/distributed.py _BucketCapacityConfig.create)
    from memplan.frameworks.ddp_replay import bucket_limits

    assert bucket_limits(25, True) == (1 << 20, 25 << 20) and bucket_limits(25, False) == (25 << 20,)
    assert bucket_limits(1, True) == (1 << 20,)

    def variants(*extra: str) -> dict:
        code, out, err = run_cli(["estimate", "llama-3-8b", "--gpus", "8", "--gpu", "h100-80g", "--json",
                                  "--no-suggestions", *extra])
        return json.loads(out)["reserved"]["variants"]

    assert variants("--bucket-cap-mb", "100") != variants()


def test_the_same_fsdp_units_give_the_same_figures():
    """--fsdp-wrap size:N and class:... are replayed with the units they make (issue 42: no flat allocated + 40%):
    size:1e9 makes no unit inside a block on llama-3-8b, the root alone as --fsdp-wrap none; class:LlamaDecoderLayer
    makes each decoder layer a unit, as --fsdp-wrap block."""
    def figures(wrap: str) -> tuple:
        code, out, err = run_cli(["estimate", "llama-3-8b", "--gpus", "8", "--strategy", "fsdp-full", "--gpu",
                                  "h100-80g", "--fsdp-wrap", wrap, "--json"])
        assert code in (0, 1), err
        rep = json.loads(out)
        g = rep["per_gpu"]
        assert "+ 40%" not in out and g["reserved_peak_bytes"] >= g["peak_bytes"]
        return rep["fits"], g["peak_bytes"], g["reserved_peak_bytes"], g["required_bytes"], g["capped"]

    assert figures("size:1e9") == figures("none")
    assert figures("class:LlamaDecoderLayer") == figures("block")
    _, peak, reserved, _, _ = figures("class:LlamaMLP")  # attention with the root, each MLP gathered with its block
    assert reserved > peak > figures("block")[1]


def test_what_is_not_replayed_is_a_bound_not_a_flat_percentage():
    # issue 42: no "allocated + 40%" where the caching allocator cannot be replayed (here FSDP2's CPU offload under
    # pipelining): the reserved peak is the allocated one, a bound from below (exact false), the required bytes
    # too; a card that holds the bound gives no verdict (fits null, MAY FIT), one that does not is DOES NOT FIT,
    # and check does not pass what it cannot confirm (UNKNOWN, exit 1); the user's own percentage decides
    job = ["llama-7b", "--gpus", "8", "--pp", "2", "--strategy", "fsdp-full", "--cpu-offload", "--grad-accum", "4"]
    code, out, err = run_cli(["estimate", *job, "--gpu", "h100-80g", "--json"])
    assert code == 0, err
    rep = json.loads(out)
    res, pg = rep["reserved"], rep["per_gpu"]
    assert (res["method"], res["exact"]) == ("bound", False) and "CPU offload under pipelining" in res["why"]
    assert pg["reserved_peak_bytes"] == pg["peak_bytes"] and rep["fits"] is None
    assert pg["required_bytes"] == pg["peak_bytes"] + pg["overhead_bytes"]
    assert "allocator_bytes" not in rep["overhead_detail"] and "fragmentation_bytes" not in rep["overhead_detail"]
    code, out, _ = run_cli(["estimate", *job, "--gpu", "h100-80g"])
    assert code == 0 and "MAY FIT on" in out and "peak reserved: ≥ " in out and "required per GPU: ≥ " in out
    code, out, _ = run_cli(["check", *job, "--gpu", "h100-80g", "--json"])
    chk = json.loads(out)["check"]
    assert code == 1 and chk["verdict"] == "unknown" and not chk["pass"] and chk["line"].startswith("UNKNOWN ")
    assert chk["required_exact"] is False
    small = ["--gpu-memory", f"{pg['required_bytes'] - 1}B"]
    code, out, _ = run_cli(["estimate", *job, *small, "--json"])
    assert code == 1 and json.loads(out)["fits"] is False
    code, out, _ = run_cli(["check", *job, *small])
    assert code == 1 and out.startswith("FAIL ") and "needs at least " in out
    code, out, _ = run_cli(["estimate", *job, "--gpu", "h100-80g", "--fragmentation-percent", "10", "--json"])
    given = json.loads(out)
    assert code == 0 and given["fits"] is True and given["reserved"]["method"] == "flat"
    assert given["per_gpu"]["reserved_peak_bytes"] == pg["peak_bytes"] + pg["peak_bytes"] * 10 // 100
