"""memplan's per-rank layout sizes (memplan/layouts.py) against the frameworks' own sharding code, called on meta
tensors for random shapes and world sizes (hypothesis):

- FSDP2: _fsdp_param.py FSDPParam._init_sharded_param pads every rank's shard to chunks[0] of
  _chunk_with_empty(param, world_size, dim=0) (_fsdp_common.py);
- FSDP1 (use_orig_params=False): each unit's FlatParameter is sharded by FlatParamHandle._get_sharded_size
  (_flat_param.py: flatten, chunk, pad to the first chunk's numel);
- DeepSpeed ZeRO-3: partition_parameters.py Init._aligned_size // world size per parameter;
- DeepSpeed ZeRO-1/2: stage_1_and_2.py pads the flat group with align_dense_tensors (runtime/utils.py) to a
  multiple of nccl_start_alignment_factor (2) x world size, splits it by get_data_parallel_partitions, and lists
  the parameters each partition overlaps by get_partition_info (grads_in_partition is sized from them).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as hs

from memplan import layouts
from memplan import strategies as S
from memplan.model.inventory import ParamInventory, ParamTensor, classify

torch = pytest.importorskip("torch")

DIMS = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "vocab_size": 50, "intermediate_size": 64}
shape = hs.lists(hs.integers(1, 257), min_size=1, max_size=3).map(tuple)
blocks = hs.lists(hs.lists(shape, min_size=1, max_size=5), min_size=1, max_size=4)
world = hs.integers(1, 64)


def inv_from(bl: list[list[tuple[int, ...]]]) -> ParamInventory:
    tensors = [ParamTensor(f"model.layers.{b}.w{i}.weight", s, "bfloat16", f"model.layers.{b}",
                           classify(f"model.layers.{b}.w{i}.weight"))
               for b, shapes in enumerate(bl) for i, s in enumerate(shapes)]
    return ParamInventory(model_name="p", source="t", builder="t", family="llama", tensors=tuple(tensors), dims=DIMS)


def meta(s: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(s, device="meta", dtype=torch.bfloat16)


@given(blocks, world)
@hsettings(max_examples=200, deadline=None)
def test_fsdp2_dim0_shards_match_fully_shard(bl, n):
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    inv = inv_from(bl)
    padded = [_chunk_with_empty(meta(t.shape), n, dim=0)[0].numel() for t in inv.tensors]
    lay = layouts.layout_sizes(inv, S.PER_PARAM_DIM0, n)
    assert lay.shard_numel == lay.optimizer_numel == sum(padded)
    assert [numel for _, numel in lay.shard_shapes] == padded


@given(blocks, world)
@hsettings(max_examples=200, deadline=None)
def test_fsdp1_flat_shards_match_flat_param_handle(bl, n):
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    inv = inv_from(bl)
    per_unit = [b.numel for b in inv.blocks if b.numel]
    shards = []
    for numel in per_unit:
        flat = torch.empty(numel, device="meta")
        sizes = {FlatParamHandle._get_sharded_size(flat, r, n)[0] for r in range(n)}
        assert len(sizes) == 1  # every rank's shard is padded to the same size
        shards.append(sizes.pop())
    assert layouts.layout_sizes(inv, S.FLAT_PER_BLOCK, n).shard_numel == sum(shards)


@given(blocks, world)
@hsettings(max_examples=200, deadline=None)
def test_zero3_partitions_match_deepspeed_init(bl, n):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.partition_parameters import Init

    inv = inv_from(bl)
    fake = SimpleNamespace(_partition_world_size=lambda p: n)
    fake._padding_size = lambda p: Init._padding_size(fake, p)
    parts = [Init._aligned_size(fake, SimpleNamespace(ds_numel=t.numel)) // n for t in inv.tensors]
    lay = layouts.layout_sizes(inv, S.PER_PARAM_NUMEL, n)
    assert lay.shard_numel == lay.optimizer_numel == sum(parts)


@given(blocks, world)
@hsettings(max_examples=200, deadline=None)
# boundaries random shapes rarely hit: a tensor ending exactly where a partition ends (it belongs to that
# partition only: get_partition_info's `current_index < start_index < current_index + tensor_size`), one starting
# exactly on a boundary, one spanning several partitions, and the padding tail
@example([[(4,), (4,)]], 2)
@example([[(2,), (6,)], [(8,)]], 4)
@example([[(3, 4)], [(4,), (4,)]], 4)
@example([[(1,), (7,)], [(24,)]], 4)
@example([[(5,)], [(3,)]], 3)
def test_zero12_flat_partitions_match_deepspeed(bl, n):
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.zero.stage_1_and_2 as z12
    from deepspeed.runtime.utils import align_dense_tensors

    inv = inv_from(bl)
    tensors = [meta(t.shape) for t in inv.tensors]
    padded = sum(t.numel() for t in align_dense_tensors(tensors, 2 * n))  # nccl_start_alignment_factor = 2
    flat = torch.empty(padded, device="meta")
    real = z12.dist.get_world_size
    z12.dist.get_world_size = lambda group=None: n
    try:
        opt = SimpleNamespace(real_dp_process_group=[None])
        partitions = z12.DeepSpeedZeroOptimizer.get_data_parallel_partitions(opt, flat, 0)
    finally:
        z12.dist.get_world_size = real
    sizes = {p.numel() for p in partitions}
    assert len(sizes) == 1  # the alignment makes every partition the same size
    size = sizes.pop()
    in_partition = [sum(t.numel() for t in z12.DeepSpeedZeroOptimizer.get_partition_info(opt, tensors, size, k)[0])
                    for k in range(n)]
    lay = layouts.layout_sizes(inv, S.FLAT_ALIGNED, n)
    assert (lay.shard_numel, lay.optimizer_numel) == (padded, size)
    assert lay.partition_params_numel == max(in_partition)


@given(blocks, world)
@hsettings(max_examples=200, deadline=None)
def test_zero_redundancy_optimizer_partition_matches_torch(bl, n):
    # ZeroRedundancyOptimizer._partition_parameters: largest first, each to the rank with the least so far; memplan
    # predicts the worst rank's elements and its parameters
    import types

    from torch.distributed.optim import ZeroRedundancyOptimizer as Zro

    inv = inv_from(bl)
    fake = SimpleNamespace(_partition_parameters_cache=[], world_size=n,
                           param_groups=[{"params": [meta(t.shape) for t in inv.tensors]}])
    for name in ("_get_min_index", "_partition_param_group", "_partition_parameters"):
        setattr(fake, name, types.MethodType(getattr(Zro, name), fake))
    per_rank = [sum(p.numel() for g in groups for p in g["params"]) for groups in fake._partition_parameters()]
    lay = layouts.layout_sizes(inv, S.GREEDY_WHOLE, n)
    assert lay.optimizer_numel == max(per_rank)
    worst = per_rank.index(max(per_rank))
    assert sorted(numel for _, numel in lay.shard_shapes) == sorted(
        p.numel() for g in fake._partition_parameters()[worst] for p in g["params"])
