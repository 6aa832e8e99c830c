"""DDP's gradient buckets (memplan/replay.py bucket_assignment) against c10d's own
compute_bucket_assignment_by_size (torch/csrc/distributed/c10d/reducer.cpp, bound as
torch.distributed._compute_bucket_assignment_by_size): tensors in order fill a bucket, and the bucket closes as
soon as its bytes reach the current limit (``bucket.size >= bucket.size_limit``), the limit then stepping to the
next one (the first bucket is capped at 1 MiB, dist._DEFAULT_FIRST_BUCKET_BYTES, the rest at bucket_cap_mb)."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as hs

from memplan.replay import bucket_assignment

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def c10d(numels: list[int], limits: list[int]) -> list[list[int]]:
    tensors = [torch.empty(x, dtype=torch.float32) for x in numels]
    order = list(range(len(tensors)))
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors), order)
    return [list(b) for b in buckets]


@given(hs.lists(hs.integers(1, 300), min_size=1, max_size=12),
       hs.lists(hs.integers(1, 80).map(lambda x: 4 * x), min_size=1, max_size=3))
@hsettings(max_examples=200, deadline=None)
@example([256, 2], [1024])  # a tensor of exactly the cap closes its bucket alone: [[0], [1]], not [[0, 1]]
@example([255, 2], [1024])  # one element under the cap: the next tensor joins it
@example([128, 128, 1, 256, 256, 3], [1024, 2048])  # the cap reached by a sum, then the second limit exactly
@example([1, 1, 1], [4])
def test_ddp_buckets_are_c10d_s(numels: list[int], limits: list[int]) -> None:
    assert bucket_assignment([4 * x for x in numels], limits) == c10d(numels, limits)


def test_a_gradient_of_exactly_the_cap_closes_its_bucket() -> None:
    # the reviewer's case: a 1 MiB cap, a 1 MiB gradient then an 8-byte one
    mib = 1 << 20
    assert bucket_assignment([mib, 8], [mib]) == [[0], [1]] == c10d([mib // 4, 2], [mib])
    # the default 25 MiB cap met exactly by a 4096 x 3200 bf16 weight's gradient (after a first 1 MiB bucket)
    assert bucket_assignment([mib, 4096 * 3200 * 2, 8], [mib, 25 * mib]) == [[0], [1], [2]]
