"""FSDP2 and FSDP1 steps replayed through the caching allocator: the H100 runs, the harness's allocations, CPU offload."""

from __future__ import annotations

from pathlib import Path

import pytest
from replayed import harness_replay, measured_settings

from memplan import accounting, options, reserved
from memplan.model.sources import build_inventory, resolve
from memplan.request import JobRequest


def test_fsdp2_llama_1b_full_recompute_matches_the_h100(tmp_path: Path) -> None:
    # truth.jsonl line 2: FSDP2 full shard, bf16 params / fp32 reduce, micro-batch 8, full recompute:
    # allocated 41,981,295,104 B, reserved 50,669,289,472 B
    inv, s = measured_settings(tmp_path, "profile_llama-3.2-1b_fsdp-bf16_2048_full_sm90.json.gz", 8, strategy="fsdp-full")
    r = reserved.predict(inv, s)
    assert r is not None and r.model == "FSDP2"
    assert r.peak_bytes == 50_669_289_472  # the measured figure, to the byte
    assert abs(r.peak_bytes - 50_669_289_472) < 50_669_289_472 // 1000
    assert abs(r.allocated_bytes - 41_981_295_104) < 1 << 20


@pytest.mark.parametrize("strategy,gpus", [("fsdp-full", 1), ("fsdp-full", 2), ("fsdp-grad-op", 2),
                                           ("fsdp-no-shard", 2)])
@pytest.mark.parametrize("precision", ["torch-amp", "fsdp-bf16", "fp32"])
def test_fsdp2_replay_unshards_in_the_parameters_dtype(strategy: str, gpus: int, precision: str) -> None:
    # FSDP2 all-gathers into MixedPrecisionPolicy.param_dtype, else the stored dtype: under torch-amp (no policy,
    # autocast) the unsharded parameters are fp32, not autocast's bf16 (the replay held half of them and its
    # allocated peak was 6% under the engine's for llama-7b NO_SHARD at micro-batch 8). NO_SHARD (a (world, 1)
    # mesh) is replayed as a shard group of one. The replay's allocated peak is the engine's.
    from memplan.frameworks import fsdp2

    src = resolve("llama-7b")
    inv = build_inventory(src)
    s = options.resolve(inv, JobRequest.of(gpus=gpus, gpu="h200-141g", strategy=strategy, precision=precision, optimizer="sgd", micro_batch=8, allocator_conf=""), config=src.config).settings
    plan = accounting.estimate(inv, s)
    r = plan.reserved
    assert r is not None and plan.reserved_why is None, plan.reserved_why
    assert abs(r.allocated_bytes - plan.peak_bytes) <= 1 << 20, (r.allocated_bytes, plan.peak_bytes)
    assert fsdp2.unshard_bytes(s.recipe) == (2 if precision == "fsdp-bf16" else 4)


@pytest.mark.parametrize("label,layers,strategy,gpus,tk", [
    ("fsdp1 full", 2, "fsdp-full", 2, {}),
    ("fsdp1 grad-op", 4, "fsdp-grad-op", 2, {}),
    ("fsdp1 no-shard", 2, "fsdp-no-shard", 2, {}),
    ("fsdp1 hybrid 2 x 2, 4 ranks", 2, "hsdp", 4, {"hsdp_shard_size": 2}),
])
def test_fsdp1_replay_walks_the_harness_s_allocations(label: str, layers: int, strategy: str, gpus: int,
                                                       tk: dict) -> None:
    # FSDP1 (FlatParameters, use_orig_params=False) replayed from its setup: the replay's sequence, counted as the
    # CPU harness's allocator counts it (requested bytes, no cache, no cuBLAS workspace), reaches the peak the
    # harness measured on the real FullyShardedDataParallel (docs/accuracy.jsonl, bench/replay_harness.py)
    name, peak, measured = harness_replay(label, layers, gpus, strategy=strategy,
                                           fsdp_version=1, **tk)
    assert name == "FSDP1"
    assert abs(peak - measured) <= 4096, (peak, measured)


def test_fsdp1_is_replayed_on_the_card() -> None:
    # no flat allocated + 40% for FSDP1: the caching allocator replayed over FSDP1's own sequence, whose allocated
    # peak is the engine's but for the allocator's rounding (a block keeps a remainder of 1 MiB or less)
    src = resolve("llama-7b")
    inv = build_inventory(src)
    # torch-amp with full recompute: FSDP1's parameters are split() views, which autocast never caches, so a
    # recomputed block's casts die with their ops (replay.uncached_casts; cached they held every block's bf16
    # weights to the forward's end: 358% over), and the second block's end (its view gradients and their
    # concatenation in fp32) is the peak the engine names too
    for strategy, gpus, precision, recompute in (("fsdp-full", 8, "fsdp-bf16", "none"),
                                                 ("fsdp-grad-op", 8, "fsdp-bf16", "none"),
                                                 ("fsdp-no-shard", 2, "fsdp-bf16", "none"),
                                                 ("fsdp-full", 1, "fsdp-bf16", "none"),
                                                 ("fsdp-full", 8, "torch-amp", "full")):
        s = options.resolve(inv, JobRequest.of(gpus=gpus, gpu="h100-80g", strategy=strategy, precision=precision, recompute=recompute, fsdp_version=1, allocator_conf=""), config=src.config).settings
        plan = accounting.estimate(inv, s)
        r = plan.reserved
        assert r is not None and r.model == "FSDP1" and plan.reserved_why is None
        assert 0 <= r.allocated_bytes - plan.peak_bytes <= plan.peak_bytes // 200, (strategy, gpus)
        assert plan.reserved_peak_bytes == r.peak_bytes > r.allocated_bytes


def test_fsdp2_cpu_offload_is_replayed() -> None:
    # CPUOffloadPolicy: shards, sharded gradients and the optimizer on the host; each unit's all-gather copies its
    # shards in (cast one by one: no foreach fast path) and each reduced shard goes to the host as it is reduced
    # (foreach_reduce: .to("cpu"), the device output freed), so no reduced gradient stays on the device in
    # backward (the engine held them all: llama-2-70b x8 full recompute 44.07 GB, the replay 13.28 GB)
    src = resolve("llama-3-8b")
    inv = build_inventory(src)
    for gpus, recompute in ((8, "none"), (1, "none"), (8, "full")):
        s = options.resolve(inv, JobRequest.of(gpus=gpus, gpu="h100-80g", strategy="fsdp-full", recompute=recompute, cpu_offload=True, allocator_conf=""), config=src.config).settings
        plan = accounting.estimate(inv, s)
        r = plan.reserved
        assert r is not None and r.model == "FSDP2" and plan.reserved_why is None
        assert 0 <= r.allocated_bytes - plan.peak_bytes <= plan.peak_bytes // 1000, (gpus, recompute)
        # on the device: the model's buffers alone (the rotary inv_freq: fully_shard and FSDP1 move buffers to the
        # device whatever the offload)
        assert all(p.weights_bytes == inv.buffer_bytes(False, 512) and p.optimizer_states_bytes == 0 for p in plan.phases)
        ends = {p.name: p.grads_bytes for p in plan.phases}  # in backward: only a block's unreduced gradients
        assert ends["backward-end"] == ends["optimizer-step"] == 0


def test_fsdp1_cpu_offload_is_replayed() -> None:
    # CPUOffload(offload_params=True): the module stays on the host; each unshard copies the shard in (cast into
    # _mp_shard), and the reduced shards stay on the device until each backward's final callback points .grad at
    # _cpu_grad (unlike FSDP2, which sends each one to the host as it is reduced)
    src = resolve("llama-3-8b")
    inv = build_inventory(src)
    for strategy in ("fsdp-full", "fsdp-grad-op"):
        s = options.resolve(inv, JobRequest.of(gpus=8, gpu="h100-80g", strategy=strategy, cpu_offload=True, fsdp_version=1, allocator_conf=""), config=src.config).settings
        plan = accounting.estimate(inv, s)
        r = plan.reserved
        assert r is not None and r.model == "FSDP1" and plan.reserved_why is None
        assert 0 <= r.allocated_bytes - plan.peak_bytes <= plan.peak_bytes // 1000, strategy
        # on the device: the model's buffers alone (the rotary inv_freq: fully_shard and FSDP1 move buffers to the
        # device whatever the offload)
        assert all(p.weights_bytes == inv.buffer_bytes(False, 512) and p.optimizer_states_bytes == 0 for p in plan.phases)
