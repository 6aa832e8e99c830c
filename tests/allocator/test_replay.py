"""The caching allocator replayed over a step's allocations: the verdict against the card, expandable segments, the allocator's configuration, the traced step's events."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from replayed import live_curve, measured_settings, tiny_events

from memplan import accounting, options, reserved
from memplan.allocator import AllocatorConfig
from memplan.model.sources import build_inventory, resolve
from memplan.request import JobRequest
from memplan.settings import Cluster


def test_the_oom_job_does_not_fit(tmp_path: Path) -> None:
    # oom.jsonl line 1: DDP torch-amp micro-batch 8 x 4096, full recompute, ran out of memory on the H100 asking
    # for 15.66 GiB with 54.91 GiB allocated and 17.84 GiB reserved but unallocated; allocated + 5% said FITS
    inv, s = measured_settings(tmp_path, "profile_llama-3.2-1b_torch-amp_4096_full_sm90.json.gz", 8, precision="torch-amp",
                       strategy="ddp")
    plan = accounting.estimate(inv, s)
    assert plan.peak_bytes < s.cluster.gpu_memory_bytes  # the allocated peak alone would fit
    assert plan.reserved_peak_bytes > s.cluster.gpu_memory_bytes
    assert plan.fits is False


def test_expandable_segments_and_the_flat_override(tmp_path: Path) -> None:
    inv, s = measured_settings(tmp_path, "profile_llama-3.2-1b_torch-amp_2048_sm90.json.gz", 4, precision="torch-amp",
                       strategy="ddp")
    default = reserved.predict(inv, s).variants
    exp = reserved.predict(inv, replace(s, allocator_conf="expandable_segments:True")).variants
    assert exp != default and all(v < default[k] for k, v in exp.items())
    flat = accounting.estimate(inv, replace(s, overheads=replace(s.overheads, fragmentation_percent=5)))
    assert flat.reserved is None and flat.reserved_why == "fragmentation given"
    assert flat.required_bytes == flat.peak_bytes + flat.peak_bytes * 5 // 100 + 512 * (1 << 20)


def test_why_not() -> None:
    class S:  # the fields why_not reads
        pass

    s = S()
    s.cluster = Cluster(device="cpu")
    assert reserved.why_not(s) == "device cpu (no caching allocator)"


def test_step_events_repeat_a_block_as_a_deeper_trace_has_it() -> None:
    traced, curve = tiny_events, live_curve

    # torch-amp keeps an fp32 residual stream; with bf16 parameters a block's output dies when the next block
    # returns (the model's loop rebinds it), which the two-block template records at the start of the final
    # norm's region: repeated, it must die after block k + 1, not after the last block (all outputs alive
    # through the forward before: 6.6 MB of difference over most of the forward's events)
    for recipe in ("torch-amp", "deepspeed-bf16"):
        two, four = traced(2, recipe), dict(traced(4, recipe), expand=False)
        for mb in (1, 3):
            (x, xs), (y, ys) = curve(reserved.step_events(two, 4, mb)), curve(reserved.step_events(four, 4, mb))
            assert xs == ys and max(x) == max(y) and len(x) == len(y)
            assert sum(a != b for a, b in zip(x, y)) <= len(x) // 100


def test_allocator_conf_is_checked(tmp_path: Path) -> None:
    from memplan.errors import SettingsError

    with pytest.raises(SettingsError, match="unrecognized key 'expandable'"):
        measured_settings(tmp_path, "profile_llama-3.2-1b_torch-amp_2048_sm90.json.gz", 4, precision="torch-amp",
                       strategy="ddp") and \
            options.resolve(build_inventory(resolve(str(tmp_path / "config.json"))), JobRequest.of(activations="analytic", allocator_conf="expandable:True"))
    assert AllocatorConfig.parse("expandable_segments:True").expandable_segments


def test_uncached_casts_die_with_their_ops() -> None:
    # a block's forward cast that lived to the autocast region's exit (the deaths right before the forward's end
    # mark) dies after the next birth once casts are not cached; one autograd saved (dying in backward) stays
    from memplan.replay import uncached_casts

    step = [("m", "F", 0), ("a", 1, (8, 0), None, 0, None), ("a", 2, (0, 4), None, 0, None),
            ("a", 3, (8, 0), None, 0, None), ("f", 2), ("m", "mid", -1), ("a", 4, (0, 4), None, 0, None),
            ("f", 1), ("m", "fwd_end", -1), ("a", 5, (0, 4), None, 0, None), ("f", 3), ("f", 4), ("f", 5)]
    out = uncached_casts(step)
    assert out == [("m", "F", 0), ("a", 1, (8, 0), None, 0, None), ("a", 2, (0, 4), None, 0, None), ("f", 1),
                   ("a", 3, (8, 0), None, 0, None), ("f", 2), ("m", "mid", -1), ("a", 4, (0, 4), None, 0, None),
                   ("m", "fwd_end", -1), ("a", 5, (0, 4), None, 0, None), ("f", 3), ("f", 4), ("f", 5)]
