"""DDP, ZeroRedundancyOptimizer and Horovod steps replayed through the caching allocator: the H100 run, c10d's bucket assignment."""

from __future__ import annotations

from pathlib import Path

import pytest
from replayed import measured_settings

from memplan import accounting, options, reserved
from memplan.model.sources import build_inventory, resolve
from memplan.request import JobRequest


def test_ddp_llama_1b_matches_the_h100(tmp_path: Path) -> None:
    # truth.jsonl line 1: DDP, torch-amp, micro-batch 4 x 2048: allocated 52,017,908,224 B, reserved
    # 56,897,830,912 B; the run released step 1's buckets at the rebuild
    inv, s = measured_settings(tmp_path, "profile_llama-3.2-1b_torch-amp_2048_sm90.json.gz", 4, precision="torch-amp",
                       strategy="ddp")
    r = reserved.predict(inv, s)
    assert r is not None and r.model == "DDP"
    # the run's own release order to the byte, since the cuBLAS workspaces come at the threads' first calls
    assert r.variants == {"buckets released at the rebuild": 56_897_830_912,
                          "buckets held into step 2's backward": 59_592_671_232}
    assert abs(r.allocated_bytes - 52_017_908_224) < 1 << 20
    plan = accounting.estimate(inv, s)
    assert plan.reserved_peak_bytes == r.peak_bytes == max(r.variants.values())
    assert plan.required_bytes == r.peak_bytes + plan.overhead_detail["cuda_context_bytes"]
    assert plan.fits is True


def test_bucket_assignment_is_c10d_s() -> None:
    mib = 1 << 20
    # llama's gradients become ready down, up, gate, then o, v, k, q and the norms: the rebuilt buckets
    sizes = [8192, 64 * mib, 64 * mib, 64 * mib, 8192, 16 * mib, 4 * mib, 4 * mib, 16 * mib, 8192]
    buckets = reserved.bucket_assignment(sizes, [mib, 25 * mib])
    assert [sum(sizes[i] for i in b) for b in buckets] == [64 * mib + 8192, 64 * mib, 64 * mib,
                                                            40 * mib + 8192, 8192]


def test_zero_redundancy_optimizer_is_replayed() -> None:
    # DDP + ZeroRedundancyOptimizer: DDP's sequence, the worst rank's optimizer stepping its own whole parameters
    # (largest first, as _partition_parameters assigns them); the replay's allocated peak is the engine's
    src = resolve("llama-3-8b")
    inv = build_inventory(src)
    s = options.resolve(inv, JobRequest.of(gpus=8, gpus_per_node=8, gpu="h100-80g", device="cuda", strategy="zero-optimizer", precision="fp32", micro_batch=1, seq_len=2048), config=src.config).settings
    plan = accounting.estimate(inv, s)
    r = plan.reserved
    assert r is not None and r.model == "DDP" and plan.reserved_why is None
    assert abs(r.allocated_bytes - plan.peak_bytes) < plan.peak_bytes // 10_000
    assert plan.reserved_peak_bytes == r.peak_bytes > r.allocated_bytes


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_horovod_is_replayed(compression: str) -> None:
    # hvd.DistributedOptimizer: the fusion buffer made at the first gradient's all-reduce and kept; with fp16
    # compression every gradient's fp16 copy lives to synchronize(), which decompresses each into a new fp32
    # gradient before the old one goes; the replay's allocated peak is the engine's
    src = resolve("llama-7b")
    inv = build_inventory(src)
    s = options.resolve(inv, JobRequest.of(gpus=8, gpu="h100-80g", strategy="horovod", optimizer="sgd", horovod_compression=compression, allocator_conf=""), config=src.config).settings
    plan = accounting.estimate(inv, s)
    r = plan.reserved
    assert r is not None and r.model == "Horovod" and plan.reserved_why is None
    assert abs(r.allocated_bytes - plan.peak_bytes) <= plan.peak_bytes // 1000
    assert plan.reserved_peak_bytes == r.peak_bytes >= r.allocated_bytes
