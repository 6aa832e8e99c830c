"""memplan plan: the batched evaluator equals estimate(); the search's answers are minimal / maximal."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from memplan import accounting as A
from memplan import options, planner
from memplan.model import sources
from memplan.request import JobRequest, SearchSpace

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "zero-optimizer", "fsdp-full", "hsdp"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_batched_evaluator_equals_estimate(strategy, recompute):
    src = sources.resolve("llama-7b")
    inv = sources.build_inventory(src)
    for activations in ("auto", "analytic"):  # the shipped traced profile, and the analytic one
        s = options.resolve(inv, JobRequest.of(gpus=16, strategy=strategy, recompute=recompute, gpu="h100-80g", activations=activations), config=src.config).settings
        mbs = [1, 2, 3, 5, 8, 13, 64]
        for b, (peak, req) in zip(mbs, A.required_bytes(inv, s, mbs)):
            p = A.estimate(inv, replace(s, micro_batch=b))
            assert (peak, req) == (p.peak_bytes, p.required_bytes), (activations, b)


def test_search_answers_are_minimal_and_maximal():
    src = sources.resolve("llama-7b")
    inv = sources.build_inventory(src)
    found = planner.search(inv, JobRequest.of(gpu="a100-40g"), SearchSpace(max_gpus=64), config=src.config)
    assert found.best is not None and found.gpus == min(c.min_gpus for c in found.candidates if c.min_gpus)
    budget = found.gpu_memory_bytes
    counts = planner.gpu_counts(8, 64)
    assert found.best.exact
    for c in found.candidates:
        if c.min_gpus is None:
            continue
        smaller = [g for g in counts if g < c.min_gpus and not (c.settings.strategy.shard_within_node and g <= 8)]
        for g in smaller:  # no smaller count fits, even by the bound from below
            assert A.required_bytes(inv, A.with_gpus(c.settings, g), (1,), lower_bound=True)[0][1] > budget
            assert A.estimate(inv, A.with_gpus(c.settings, g)).required_bytes > budget, (c.label, g)
        if c.micro_batch is None:
            continue
        at = replace(A.with_gpus(c.settings, found.gpus), micro_batch=c.micro_batch)
        more = replace(at, micro_batch=c.micro_batch + 1)
        if c.exact:  # replayed: it fits, and one more micro-batch does not
            assert A.estimate(inv, at).required_bytes == c.required_bytes <= budget, c.label
            if c.micro_batch < 64:
                assert A.estimate(inv, more).required_bytes > budget
        else:  # the bound: the largest micro-batch by the allocated peak (the true one is no larger)
            assert A.required_bytes(inv, at, (c.micro_batch,), lower_bound=True)[0][1] == c.required_bytes <= budget
            if c.micro_batch < 64:
                assert A.required_bytes(inv, more, (c.micro_batch + 1,), lower_bound=True)[0][1] > budget
    b = found.best
    assert all(planner.RECOMPUTE_ORDER.index(b.recompute) <= planner.RECOMPUTE_ORDER.index(c.recompute)
               for c in found.candidates if c.micro_batch is not None)


def test_gpu_counts():
    assert list(planner.gpu_counts(8, 40)) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert list(planner.gpu_counts(4, 3)) == [1, 2]
    # a layout's multiples, above one node (HSDP), and a million GPUs without listing them
    assert list(planner.GpuCounts(8, 64, multiple=16)) == [16, 32, 48, 64]
    assert list(planner.GpuCounts(8, 40, multiple=2, above_node=True)) == [16, 24, 32, 40]
    assert list(planner.GpuCounts(6, 30, multiple=4)) == [4, 12, 24]
    big = planner.gpu_counts(8, 1 << 20)
    assert len(big) == 3 + (1 << 17) and big[-1] == 1 << 20 and big.index_at_least(1000) == 3 + 124


def test_zero_optimizer_partition_at_many_ranks():
    # ZeroRedundancyOptimizer's greedy rule (sizes.index(min(sizes))) at more ranks than tensors: one each, in
    # size order, the largest tensor's rank the worst; at two ranks the usual alternation
    from memplan.layouts import greedy_whole

    assert greedy_whole([5, 9, 7], 1 << 20) == ([1], 0)
    assert greedy_whole([5, 9, 7, 3], 2) == ([1, 3], 0)
    assert greedy_whole([4, 4, 4], 2) == ([0, 2], 0)


def _run(*args):
    return subprocess.run([sys.executable, "-m", "memplan", *args], capture_output=True, text=True, cwd=ROOT)


def test_plan_cli_json_and_exit_codes():
    r = _run("plan", "llama-7b", "--gpu", "h100-80g", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    rec = d["recommendation"]
    assert d["schema_version"] == 1 and d["fits"] is True
    assert d["estimate"]["per_gpu"]["required_bytes"] == rec["required_bytes"] <= d["search"]["gpu_memory_bytes"]
    assert d["estimate"]["cluster"]["gpus"] == rec["gpus"] and rec["command"].startswith("memplan estimate llama-7b")
    # the printed command reproduces the recommendation
    again = _run(*rec["command"].split()[1:], "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["per_gpu"]["required_bytes"] == rec["required_bytes"]
    none = _run("plan", "llama-70b", "--gpu", "rtx4090-24g", "--max-gpus", "8", "--json")
    assert none.returncode == 1 and json.loads(none.stdout)["recommendation"] is None


@pytest.mark.parametrize("args, message", [
    ([], "plan needs the GPU"),
    (["--gpu", "h100-80g", "--strategies", "ddp,nope"], "unknown strategy 'nope'"),
    (["--gpu", "h100-80g", "--recompute", "some"], "unknown recompute 'some'"),
    (["--gpu", "h100-80g", "--max-gpus", "0"], "--max-gpus must be at least 1"),
    (["--gpu", "h100-80g", "--micro-batch", "0"], "micro-batch must be at least 1"),
    (["--gpu", "h100-80g", "--gpus-per-node", "0"], "--gpus-per-node must be at least 1"),
    (["--gpu", "h100-80g", "--strategies", ","], "--strategies needs at least one value"),
    (["--gpu-memory", "-5GB"], "memory size '-5GB'"),
])
def test_plan_bad_input(args, message):
    r = _run("plan", "llama-7b", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1


def test_plan_weighs_one_gpu_without_ddp_at_one_gpu_only():
    # `single` (no DDP wrapper) is a candidate at one GPU and no other count
    from memplan import planner
    from memplan.model import sources

    src = sources.resolve("gpt2")
    inv = sources.build_inventory(src)
    found = planner.search(inv, JobRequest.of(gpu="h100-80g"),
                           SearchSpace(strategies=("single", "ddp"), recomputes=("none",), max_micro_batch=8),
                           config=src.config)
    single = next(c for c in found.candidates if c.strategy == "single")
    ddp = next(c for c in found.candidates if c.strategy == "ddp")
    assert single.min_gpus == 1 and found.gpus == 1
    assert single.peak_bytes < ddp.peak_bytes  # the same job without the Reducer's buckets


@pytest.mark.parametrize("gpus", [32, 16, 8])  # never reaches the card, fits only after flushes, out of memory
def test_a_search_at_the_card_replays_once_and_answers_as_two_replays_do(gpus, monkeypatch):
    # a search whose budget is the card asks the replay stopped at the allocator's limit, then the verdict's replay
    # under the card; one replay under the card answers both (memplan/reserved.py), with the figures of the two
    # (replays are kept per inventory object: each road gets its own)
    from memplan import frameworks, reserved
    from memplan.frameworks import zero3_replay

    src = sources.resolve("llama-70b")
    s = options.resolve(sources.build_inventory(src), JobRequest.of(gpus=gpus, strategy="zero3", recompute="full",
                                                                    gpu="h100-80g"), config=src.config).settings
    budget = s.cluster.gpu_memory_bytes
    detail = A.estimate(sources.build_inventory(src), s).overhead_detail
    limit = budget - detail["cuda_context_bytes"] - detail["nccl_bytes"]  # the allocator's share of the card
    replays = []
    made = zero3_replay.replay
    monkeypatch.setattr(zero3_replay, "replay", lambda *a: replays.append(1) or made(*a))
    one = sources.build_inventory(src)
    (peak, req), = A.required_bytes(one, s, (1,), budget=budget)
    p = A.estimate(one, s, limit)
    assert len(replays) == 1 and (peak, req) == (p.peak_bytes, p.required_bytes)
    two = frameworks.with_unreached(sources.build_inventory(src), s)
    stopped = reserved.predict(two, s, limit=limit)  # stopped at the limit, then the replay under the card
    assert len(replays) == 2
    assert (stopped, reserved.capped(two, s, limit, None, stopped)) == (p.reserved, p.capped)
    assert (p.reserved.complete, p.capped.fits, p.capped.flushes > 0) == {32: (True, True, False),
                                                                         16: (False, True, True),
                                                                         8: (False, False, True)}[gpus]
