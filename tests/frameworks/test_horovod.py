"""Horovod (memplan/frameworks/ddp.py, derived from horovod's source: Horovod is not installed here, so no
harness run): DDP's memory without the Reducer's buckets, plus the persistent fusion buffer, plus fp16
compression's copies."""

from __future__ import annotations

import pytest

from memplan import accounting, options
from memplan.errors import SettingsError
from memplan.model import sources
from memplan.request import JobRequest

MiB = 2**20


def _plan(strategy: str, gpus: int = 8, **kw):
    src = sources.resolve("llama-7b")
    inv = sources.build_inventory(src)
    s = options.resolve(inv, JobRequest.of(gpus=gpus, strategy=strategy, activations="analytic", **kw), config=src.config).settings
    return inv, accounting.estimate(inv, s)


def test_fusion_buffer_instead_of_ddp_buckets():
    inv, ddp = _plan("ddp")
    _, hv = _plan("horovod")
    psi = inv.num_params
    for a, b in zip(ddp.phases, hv.phases):
        # DDP's buckets hold every fp32 gradient (torch-amp); Horovod's fusion buffer is 128 MiB
        assert b.buffers_bytes - a.buffers_bytes == 128 * MiB - 4 * psi, a.name
        assert (b.grads_bytes, b.activations_bytes) == (a.grads_bytes, a.activations_bytes)
    assert hv.assumptions["horovod_fusion_buffer"] == 128 * MiB
    _, one = _plan("horovod", gpus=1)
    _, single = _plan("single", gpus=1)
    assert one.peak_bytes == single.peak_bytes  # one rank: no all-reduce, no fusion buffer


def test_fp16_compression_copies_every_gradient_to_the_step(monkeypatch):
    inv, plain = _plan("horovod")
    _, fp16 = _plan("horovod", horovod_compression="fp16")
    end = {p.name: p for p in plain.phases}["backward-end"]
    end16 = {p.name: p for p in fp16.phases}["backward-end"]
    largest = max(t.numel for t in inv.tensors)
    assert end16.buffers_bytes - end.buffers_bytes == 2 * inv.num_params + 4 * largest


def test_fusion_threshold_from_the_environment_and_the_command_line(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(64 * MiB))
    _, env = _plan("horovod")
    assert env.settings.horovod.fusion_threshold == 64 * MiB
    _, cli = _plan("horovod", horovod_fusion_threshold=32 * MiB)
    assert cli.settings.horovod.fusion_threshold == 32 * MiB
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "lots")
    with pytest.raises(SettingsError, match="HOROVOD_FUSION_THRESHOLD"):
        _plan("horovod")


def test_horovod_options_elsewhere_and_bad_values_are_refused():
    with pytest.raises(SettingsError, match="Horovod's"):
        _plan("ddp", horovod_compression="fp16")
    with pytest.raises(SettingsError, match="none or fp16"):
        _plan("horovod", horovod_compression="zip")


def test_communication_in_fp16_when_compressed():
    from memplan.comm import communication

    inv, hv = _plan("horovod", horovod_compression="fp16")
    (x,) = communication(inv, hv.settings)["collectives"]
    assert (x["op"], x["dtype_bytes"], x["bytes_per_gpu"]) == ("all-reduce", 2, 2 * 7 * 2 * inv.num_params // 8)
