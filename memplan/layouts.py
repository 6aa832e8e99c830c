"""Per-rank sizes that follow from how a strategy lays tensors out (see the layout constants in strategies.py).

Computed once per (inventory, layout, shard count) and cached: a 405B inventory has ~1,100 tensors, and the
planner evaluates many configurations of the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan import strategies as S
from memplan.model.inventory import ROOT_BLOCK, ParamInventory
from memplan.precision import Optimizer, Recipe, state_bytes_for
from memplan.units import ceil_div, round_up

#: DeepSpeed ZeRO-1/2 pads each flat group to a multiple of nccl_start_alignment_factor * dp_size, factor 2
#: ("4-byte alignment / sizeof(fp16)", deepspeed/runtime/zero/stage_1_and_2.py).
DS_NCCL_START_ALIGNMENT_FACTOR = 2


@dataclass(frozen=True)
class LayoutSizes:
    shard_numel: int  #: parameter elements this rank stores (its partition / shard; all of them if replicated)
    optimizer_numel: int  #: elements the worst rank's optimizer updates (states, master, fp32 grads)
    largest_optimizer_tensor: int  #: elements of the largest single tensor that rank's optimizer steps on
    persistent_numel: int  #: ZeRO-3 params kept whole (numel <= persistence threshold), elements
    matmul_numel: int  #: weights read by matmuls (autocast casts these), elements
    shard_shapes: tuple[tuple[tuple[int, ...], int], ...]  #: (full shape, this rank's elements) per tensor


@dataclass(frozen=True)
class GatherSizes:
    largest_block: int  #: padded elements of the largest layer block (what one all-gather materialises)
    root: int  #: padded elements of the root group (embeddings, final norm, head)
    total_blocks: int  #: padded elements of all layer blocks
    block_numels: tuple[int, ...]
    total_sharded: int  #: elements of all non-persistent parameters


_cache: dict[tuple, tuple[ParamInventory, object]] = {}


def _cached(inv: ParamInventory, key: tuple, make):
    k = (id(inv),) + key
    hit = _cache.get(k)
    if hit is not None and hit[0] is inv:
        return hit[1]
    value = make()
    if len(_cache) > 4096:
        _cache.clear()
    _cache[k] = (inv, value)
    return value


def _dim0_shard(shape: tuple[int, ...], n: int) -> int:
    if not shape:
        return 1
    rest = 1
    for d in shape[1:]:
        rest *= d
    return ceil_div(shape[0], n) * rest


def layout_sizes(inv: ParamInventory, layout: str, n: int, persistence_threshold: int = 0) -> LayoutSizes:
    return _cached(inv, ("layout", layout, n, persistence_threshold),
                   lambda: _layout_sizes(inv, layout, n, persistence_threshold))


def _layout_sizes(inv: ParamInventory, layout: str, n: int, threshold: int) -> LayoutSizes:
    tensors = inv.tensors
    psi = inv.num_params
    matmul = sum(t.numel for t in tensors if len(t.shape) >= 2 and (t.category != "embedding" or t.tied_names))
    persistent = 0
    if layout == S.REPLICATED:
        shard = opt = psi
        shapes = tuple((t.shape, t.numel) for t in tensors)
        largest = max(t.numel for t in tensors)
    elif layout == S.FLAT_ALIGNED:
        # every rank keeps the whole (padded) bf16 flat buffer; master, states and fp32 grads are partitioned
        shard = round_up(psi, DS_NCCL_START_ALIGNMENT_FACTOR * n)
        opt = shard // n
        shapes = tuple((t.shape, ceil_div(t.numel, n)) for t in tensors)
        largest = opt  # the optimizer steps on one flat fp32 partition
    elif layout == S.PER_PARAM_NUMEL:
        parts = [ceil_div(t.numel, n) for t in tensors]
        shard = opt = sum(parts)
        persistent = sum(t.numel for t in tensors if t.numel <= threshold)
        shapes = tuple((t.shape, p) for t, p in zip(tensors, parts))
        largest = opt  # fp32 partitions are flattened per sub group (sub_group_size 1e9 by default)
    elif layout == S.PER_PARAM_DIM0:
        parts = [_dim0_shard(t.shape, n) for t in tensors]
        shard = opt = sum(parts)
        shapes = tuple((t.shape, p) for t, p in zip(tensors, parts))
        largest = max(parts)
    elif layout == S.FLAT_PER_BLOCK:
        shard = opt = sum(round_up(b.numel, n) // n for b in inv.blocks if b.numel)
        shapes = tuple((t.shape, ceil_div(t.numel, n)) for t in tensors)
        largest = max(round_up(b.numel, n) // n for b in inv.blocks if b.numel)
    elif layout == S.GREEDY_WHOLE:
        # ZeroRedundancyOptimizer._partition_parameters: sorted by numel (stable, largest first), each to the
        # first rank with the smallest total so far; the worst rank is predicted.
        sizes = [0] * n
        members: list[list[int]] = [[] for _ in range(n)]
        for i in sorted(range(len(tensors)), key=lambda j: tensors[j].numel, reverse=True):
            r = sizes.index(min(sizes))
            sizes[r] += tensors[i].numel
            members[r].append(i)
        worst = sizes.index(max(sizes))
        shard, opt = psi, sizes[worst]
        shapes = tuple((tensors[i].shape, tensors[i].numel) for i in members[worst])
        largest = max((tensors[i].numel for i in members[worst]), default=0)
    else:  # pragma: no cover - the strategy table only uses the layouts above
        raise ValueError(f"unknown layout {layout}")
    return LayoutSizes(shard, opt, largest, persistent, matmul, shapes)


def optimizer_state_bytes(inv: ParamInventory, opt: Optimizer, recipe: Recipe, lay: LayoutSizes,
                          sharded: bool) -> int:
    """Optimizer-state bytes on the worst rank. Exact for Adam/SGD (states x elements)."""
    if not opt.factored and opt.state_bytes_override is None:
        return opt.states_per_param * recipe.state_bytes * lay.optimizer_numel
    if not sharded:
        return sum(state_bytes_for(opt, recipe, t.shape, t.numel) for t in inv.tensors)
    return sum(state_bytes_for(opt, recipe, shape, numel) for shape, numel in lay.shard_shapes)


def gather_sizes(inv: ParamInventory, layout: str, n: int) -> GatherSizes:
    return _cached(inv, ("gather", layout, n), lambda: _gather_sizes(inv, layout, n))


def _gather_sizes(inv: ParamInventory, layout: str, n: int) -> GatherSizes:
    per_block: dict[str, int] = {}
    for t in inv.tensors:
        if layout == S.PER_PARAM_DIM0:
            padded = _dim0_shard(t.shape, n) * n
        elif layout == S.PER_PARAM_NUMEL:
            padded = ceil_div(t.numel, n) * n
        else:
            padded = t.numel
        per_block[t.block] = per_block.get(t.block, 0) + padded
    if layout == S.FLAT_PER_BLOCK:
        per_block = {b: round_up(v, n) for b, v in per_block.items()}
    root = per_block.pop(ROOT_BLOCK, 0)
    blocks = tuple(per_block.values())
    return GatherSizes(largest_block=max(blocks, default=root), root=root, total_blocks=sum(blocks),
                       block_numels=blocks, total_sharded=inv.num_params)


def ceil_sum(numels: tuple[int, ...], r: int) -> int:
    return sum(ceil_div(b, r) for b in numels)
