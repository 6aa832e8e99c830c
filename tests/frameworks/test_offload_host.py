"""Host memory for offloaded states (memplan/host.py): pinned buffers rounded as PyTorch's pinned allocator
rounds them, the host verdict, and where the settings come from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from memplan import accounting, options
from memplan.host import host_report, pinned_size
from memplan.model import sources
from memplan.request import JobRequest

ROOT = Path(__file__).resolve().parents[2]


def test_pinned_size_is_the_next_power_of_two() -> None:
    # ATen/core/CachingHostAllocator.h: roundSize = c10::llvm::PowerOf2Ceil(size)
    assert [pinned_size(n) for n in (0, 1, 2, 3, 4096, 4097, 5 << 30)] == [0, 1, 2, 4, 4096, 8192, 8 << 30]


def _plan(**kw):  # noqa: ANN003, ANN202
    inv = sources.build_inventory(sources.resolve("llama-70b"))
    return accounting.estimate(inv, options.resolve(inv, JobRequest.of(gpus=8, activations="analytic", **kw)).settings)


def test_zero_offload_pins_its_flat_partitions() -> None:
    pageable = host_report(_plan(stage=2, offload_optimizer=True))
    pinned = host_report(_plan(stage=2, offload_optimizer=True, pin_memory=True))
    assert pageable["pinned_requested_bytes_per_rank"] == 0
    req, alloc = pinned["pinned_requested_bytes_per_rank"], pinned["pinned_allocated_bytes_per_rank"]
    # stage_1_and_2.py: fp32 partition, its fp32 gradient, the bit16 copy, the largest-parameter gradient buffer
    tensors = _plan(stage=2).inventory.tensors
    psi, largest = sum(t.numel for t in tensors), max(t.numel for t in tensors)  # llama-2-70b: 32000 x 8192
    part = -(-psi // 8)
    assert largest == 32000 * 8192 and req == 4 * part * 2 + 2 * part + 2 * largest
    assert alloc == 2 * pinned_size(4 * part) + pinned_size(2 * part) + pinned_size(2 * largest)
    assert pinned["bytes_per_node"] == 8 * (pinned["pageable_bytes_per_rank"] + alloc) > pageable["bytes_per_node"]


def test_host_verdict_and_exit_code(tmp_path: Path) -> None:
    small = _plan(stage=3, offload_optimizer=True, offload_param=True, host_memory="1TiB")
    assert small.host_fits is False and host_report(small)["headroom_bytes"] < 0
    big = _plan(stage=3, offload_optimizer=True, offload_param=True, host_memory="4TiB")
    assert big.host_fits is True
    assert _plan(stage=3, host_memory="1TiB").host_fits is None  # nothing offloaded: no host verdict
    r = subprocess.run([sys.executable, "-m", "memplan", "estimate", "llama-70b", "--gpus", "8", "--stage", "3",
                        "--offload-optimizer", "--offload-param", "--host-memory", "1TiB", "--activations",
                        "analytic", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and json.loads(r.stdout)["host"]["fits"] is False


def test_ds_config_pin_memory(tmp_path: Path) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                                        "pin_memory": True}}}))
    inv = sources.build_inventory(sources.resolve("llama-7b"))
    s = options.resolve(inv, JobRequest.of(deepspeed=str(cfg), activations="analytic")).settings
    assert s.ds.offload_optimizer and s.ds.offload_pin_memory
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                                        "pin_memory": "maybe"}}}))
    r = subprocess.run([sys.executable, "-m", "memplan", "estimate", "llama-7b", "--deepspeed", str(cfg)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "pin_memory must be true or false" in r.stderr
