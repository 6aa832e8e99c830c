"""DeepSpeed ZeRO steps replayed through the caching allocator: the H100 runs, stage 0's wrapper, offload's fp64 copies, hpZ, persistent parameters."""

from __future__ import annotations

from pathlib import Path

from replayed import measured_settings

from memplan import accounting, options, reserved
from memplan.model.sources import build_inventory, resolve
from memplan.request import JobRequest


def test_deepspeed_zero1_and_zero3_llama_1b_match_the_h100(tmp_path: Path) -> None:
    # truth.jsonl: DeepSpeed bf16, full recompute, 2048 tokens. ZeRO-1 at micro-batch 8 reserved
    # 51,466,207,232 B; ZeRO-3 at micro-batch 4 reserved 39,541,800,960 B (allocated 43,928,498,688 and
    # 34,120,864,256 B)
    profile = "profile_llama-3.2-1b_deepspeed-bf16_2048_full_sm90.json.gz"
    inv, s = measured_settings(tmp_path, profile, 8, stage=1)
    r = reserved.predict(inv, s)
    assert r.model == "ZeRO-1" and r.peak_bytes == 51_466_207_232  # the measured figure, to the byte
    assert abs(r.allocated_bytes - 43_928_498_688) < 1 << 20
    inv, s = measured_settings(tmp_path, profile, 4, stage=3)
    r = reserved.predict(inv, s)
    assert r.model == "ZeRO-3" and abs(r.allocated_bytes - 34_120_864_256) < 1 << 20
    assert r.peak_bytes == 39_541_800_960  # the measured figure, to the byte
    # the optimizer offloaded (../shared/gpu/traces/zero3_offload: reserved 22,684,893,184 B at micro-batch 4)
    inv, s = measured_settings(tmp_path, profile, 4, stage=3, offload_optimizer=True)
    r = reserved.predict(inv, s)
    assert r.model == "ZeRO-3 Offload" and r.peak_bytes == 22_684_893_184
    # the parameters offloaded too (ZeRO-Infinity on the host): replayed, each fetched to the device on the
    # coordinator's stream (tests/unit/test_reserved_streams.py checks it against a recorded run)
    inv, s = measured_settings(tmp_path, profile, 4, stage=3, offload_optimizer=True, offload_param=True)
    r = reserved.predict(inv, s)
    assert r.model == "ZeRO-3 Offload (parameters too)" and r.peak_bytes >= r.allocated_bytes
    # no device partitions: below the run that keeps them on the device
    assert r.allocated_bytes < 16_819_802_112
    # the parameters offloaded with the optimizer on the device: the fp32 partitions, the flat gradient buffer and
    # the step on the device, the bit16 partitions on the host and fetched as above; the replay's allocated peak
    # is the engine's
    inv, s = measured_settings(tmp_path, profile, 4, stage=3, offload_param=True)
    plan = accounting.estimate(inv, s)
    r = plan.reserved
    assert r is not None and r.model == "ZeRO-3 (parameters too)" and plan.reserved_why is None
    assert abs(r.allocated_bytes - plan.peak_bytes) < plan.peak_bytes // 1000
    assert plan.peak_bytes < 34_120_864_256  # below the run that keeps the bit16 partitions on the device


def test_deepspeed_stage_0_is_replayed_with_its_wrapper(tmp_path: Path) -> None:
    # stage 0 with bf16: a torch optimizer handed to DeepSpeed (an --optimizer-impl named, as the H100 harness's
    # fused torch AdamW) is wrapped in FP16_UnfusedOptimizer (an fp32 copy per parameter, its gradients cast one by
    # one); DeepSpeed's own FusedAdam (no --optimizer-impl on CUDA) in FP16_Optimizer (one flat fp32 group, every
    # gradient cast in a list, then flattened). The replay's allocated peak is the engine's in each.
    profile = "profile_llama-3.2-1b_deepspeed-bf16_2048_full_sm90.json.gz"
    peaks = {}
    for impl, model in (("fused", "DeepSpeed stage 0 (FP16_UnfusedOptimizer)"),
                        (None, "DeepSpeed stage 0 (FP16_Optimizer)")):
        inv, s = measured_settings(tmp_path, profile, 1, stage=0, optimizer_impl=impl)
        plan = accounting.estimate(inv, s)
        r = plan.reserved
        assert r is not None and r.model == model and plan.reserved_why is None
        assert plan.peak.name == "optimizer-step"
        assert abs(r.allocated_bytes - plan.peak_bytes) < plan.peak_bytes // 1000
        assert plan.reserved_peak_bytes == r.peak_bytes > r.allocated_bytes
        peaks[impl] = plan.peak_bytes
    # FP16_Optimizer's step holds the fp32 casts and their flat copy together: 4 bytes a parameter more
    inv, _ = measured_settings(tmp_path, profile, 1, stage=0)
    assert peaks[None] - peaks["fused"] == 4 * inv.num_params


def test_zero_offload_reduce_copies_each_gradient_through_fp64(tmp_path: Path) -> None:
    # ZeRO-Offload (stages 1 and 2): each reduced gradient of the rank's partition goes to the host through its
    # fp64 norm copy (stage_1_and_2.py set_norm_for_param_grad_in_gpu), and one larger than reduce_bucket_size stays
    # apart beside it (extra_large_param_to_reduce); ZeRO-1 reduces after backward with every gradient alive. The
    # engine's moments and the replay's sequence agree (a sweep of the H100 configurations found them 2x apart
    # before, the engine under)
    profile = "profile_llama-3.2-1b_deepspeed-bf16_2048_full_sm90.json.gz"
    embedding = 128256 * 2048
    for stage, phase in ((1, "backward-end"), (2, "backward-start")):
        inv, s = measured_settings(tmp_path, profile, 1, stage=stage,
                           offload_optimizer=True, reduce_bucket_size=100_000_000)
        plan = accounting.estimate(inv, s)
        r = plan.reserved
        assert r is not None and r.model == f"ZeRO-{stage} Offload"
        assert abs(r.allocated_bytes - plan.peak_bytes) < plan.peak_bytes // 1000
        assert plan.peak.name == phase
    # ZeRO-1: the embedding's copy (first in module order, larger than the bucket, kept apart and cloned) beside
    # every bf16 gradient, the flat parameters, the bucket and the offload's gradient buffer
    inv, s = measured_settings(tmp_path, profile, 1, stage=1,
                       offload_optimizer=True, reduce_bucket_size=100_000_000)
    plan = accounting.estimate(inv, s)
    ends = {p.name: p.total_bytes for p in plan.phases}
    assert ends["backward-end"] - ends["optimizer-step"] >= 2 * inv.num_params + 8 * embedding


def test_zero3_hpz_is_replayed() -> None:
    # ZeRO++ hpZ: each parameter's secondary partition over zero_hpz_partition_size ranks, made at its first
    # release (partition_parameters.py _partition -> _partition_param_sec) and dropped at the step's end
    # (stage3.py _post_step: invalidate_secondary_tensor); the parameters' fetches follow the coordinator as
    # without it. The engine holds every secondary partition through the whole step, an upper bound: from the
    # second step on, what the coordinator keeps from forward into backward (the head, within
    # stage3_max_reuse_distance) has none at backward's start, so the replay's allocated peak is below it by up
    # to the head's secondary (llama-3-8b over 8: 131 MB, 0.44%)
    src = resolve("llama-3-8b")
    inv = build_inventory(src)
    peaks = {}
    for hpz in (1, 8):
        s = options.resolve(inv, JobRequest.of(gpus=16, gpus_per_node=8, gpu="h100-80g", stage=3, hpz_partition_size=hpz, allocator_conf=""), config=src.config).settings
        plan = accounting.estimate(inv, s)
        r = plan.reserved
        assert r is not None and plan.reserved_why is None
        assert -plan.peak_bytes // 1000 <= plan.peak_bytes - r.allocated_bytes <= plan.peak_bytes * (5 if hpz > 1 else 1) // 1000
        peaks[hpz] = r.allocated_bytes
    assert peaks[8] > peaks[1]  # the secondary partitions
    # with offload_param the secondary partitions live on the host (_partition_param_sec: remote_device); each
    # gather that reads one copies it to the device first, numel / hpz elements where the primary's copy is
    # numel / n: the same allocated peak, a larger transient in the fetch stream's pool
    reserved = {}
    for hpz in (1, 8):
        s = options.resolve(inv, JobRequest.of(gpus=16, gpus_per_node=8, gpu="h100-80g", stage=3, hpz_partition_size=hpz,
                                               offload_param=True, allocator_conf=""), config=src.config).settings
        plan = accounting.estimate(inv, s)
        r = plan.reserved
        assert r is not None and plan.reserved_why is None, plan.reserved_why
        assert abs(r.allocated_bytes - plan.peak_bytes) <= plan.peak_bytes // 1000
        reserved[hpz] = (r.allocated_bytes, r.peak_bytes, plan.host_bytes_per_node)
    assert reserved[8][0] == reserved[1][0] and reserved[8][1] > reserved[1][1]
    # on the host: a secondary partition of every parameter per rank, 8 ranks a node
    assert reserved[8][2] - reserved[1][2] == 8 * 2 * sum(-(-t.numel // 8) for t in inv.tensors)


def test_zero3_replay_holds_persistent_parameters_whole() -> None:
    # parameters under stage3_param_persistence_threshold are gathered where their module first runs and never
    # released until the step (parameter_offload.py mark_persistent_parameters; the coordinator's
    # __params_to_release skips ds_persist; stage3.py step releases all and _post_step gathers them again): the
    # replay's allocated peak follows the engine's as the threshold moves, and reserved never falls below it
    src = resolve("llama-3-8b")
    inv = build_inventory(src)
    for threshold in (0, 100_000, 20_000_000, 100_000_000):
        s = options.resolve(inv, JobRequest.of(gpus=8, gpus_per_node=8, gpu="a100-80g", device="cuda", stage=3, micro_batch=1, seq_len=2048, param_persistence_threshold=threshold), config=src.config).settings
        plan = accounting.estimate(inv, s)
        r = plan.reserved
        assert r is not None and plan.reserved_why is None, threshold
        assert abs(r.allocated_bytes - plan.peak_bytes) < plan.peak_bytes // 1000, threshold
        assert plan.reserved_peak_bytes == r.peak_bytes >= plan.peak_bytes, threshold
