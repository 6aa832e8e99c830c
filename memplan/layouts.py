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
    #: single-tensor Adam's temporaries at their worst, in elements: for each tensor in the optimizer's order,
    #: exp_avg_sq.sqrt() and its division make two tensor-sized temporaries while the previous tensor's
    #: denominator is still bound to the loop's local (torch/optim/adam.py _single_tensor_adam; measured with
    #: FSDP1's flat parameters, session 5): max over i of n[i-1] + 2 n[i]
    single_step_scratch: int
    persistent_numel: int  #: ZeRO-3 params kept whole (numel <= persistence threshold), elements
    matmul_numel: int  #: weights read by matmuls (autocast casts these), elements
    shard_shapes: tuple[tuple[tuple[int, ...], int], ...]  #: (full shape, this rank's elements) per tensor
    #: ZeRO-1/2 (flat aligned): the most elements, over ranks, of the whole parameters that overlap a rank's
    #: partition; stage_1_and_2.py sizes grads_in_partition as sum(p.numel() for p in params_in_partition)
    partition_params_numel: int = 0


@dataclass(frozen=True)
class GatherSizes:
    largest_block: int  #: padded elements of the largest layer block (what one all-gather materialises)
    root: int  #: padded elements of the root group (embeddings, final norm, head)
    total_blocks: int  #: padded elements of all layer blocks
    block_numels: tuple[int, ...]
    total_sharded: int  #: elements of all non-persistent parameters
    #: padded elements of the root's tensors used after the blocks (final norm, head; a tied embedding too):
    #: their grads exist from the head's backward on, through every block's backward
    root_head: int = 0
    #: padded elements of the largest single tensor in a layer block, and in the root
    largest_tensor: int = 0
    root_largest_tensor: int = 0
    #: elements of tied tensors (a tied embedding), and of the largest untied root tensor used after the blocks
    #: (the head), unpadded
    tied: int = 0
    head_largest_tensor: int = 0


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


def _pairs(numels: list[int]) -> int:
    """max over i of numels[i-1] + 2 numels[i] (see LayoutSizes.single_step_scratch)."""
    best, prev = 0, 0
    for x in numels:
        best = max(best, prev + 2 * x)
        prev = x
    return best


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
    partition_params = 0
    if layout == S.REPLICATED:
        shard = opt = psi
        shapes = tuple((t.shape, t.numel) for t in tensors)
        largest = _pairs([t.numel for t in tensors])
    elif layout == S.FLAT_ALIGNED:
        # every rank keeps the whole (padded) bf16 flat buffer; master, states and fp32 grads are partitioned
        shard = round_up(psi, DS_NCCL_START_ALIGNMENT_FACTOR * n)
        opt = shard // n
        shapes = tuple((t.shape, ceil_div(t.numel, n)) for t in tensors)
        largest = 2 * opt  # the optimizer steps on one flat fp32 partition
        in_partition = [0] * n
        start = 0
        for t in tensors:  # the flat buffer holds the parameters in order; a parameter belongs to every
            end = start + t.numel  # partition it overlaps
            for k in range(start // opt, min(n - 1, (end - 1) // opt) + 1) if t.numel else ():
                in_partition[k] += t.numel
            start = end
        partition_params = max(in_partition)
    elif layout == S.PER_PARAM_NUMEL:
        parts = [ceil_div(t.numel, n) for t in tensors]
        shard = opt = sum(parts)
        persistent = sum(t.numel for t in tensors if t.numel <= threshold)
        shapes = tuple((t.shape, p) for t, p in zip(tensors, parts))
        largest = 2 * opt  # fp32 partitions are flattened per sub group (sub_group_size 1e9 by default)
    elif layout == S.PER_PARAM_DIM0:
        parts = [_dim0_shard(t.shape, n) for t in tensors]
        shard = opt = sum(parts)
        shapes = tuple((t.shape, p) for t, p in zip(tensors, parts))
        largest = _pairs(parts)
    elif layout == S.FLAT_PER_BLOCK:
        shard = opt = sum(round_up(b.numel, n) // n for b in inv.blocks if b.numel)
        shapes = tuple((t.shape, ceil_div(t.numel, n)) for t in tensors)
        largest = _pairs([round_up(b.numel, n) // n for b in inv.blocks if b.numel])  # the root's first
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
        largest = _pairs([tensors[i].numel for i in members[worst]])  # its params, largest first
    else:  # pragma: no cover - the strategy table only uses the layouts above
        raise ValueError(f"unknown layout {layout}")
    return LayoutSizes(shard, opt, largest, persistent, matmul, shapes, partition_params)


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
    root_head = tied = head_largest = 0
    largest = {True: 0, False: 0}  # root?: the largest padded tensor
    seen_block = False
    for t in inv.tensors:
        seen_block = seen_block or t.block != ROOT_BLOCK
        if t.tied_names:
            tied += t.numel
        elif t.block == ROOT_BLOCK and seen_block:
            head_largest = max(head_largest, t.numel)
        if layout == S.PER_PARAM_DIM0:
            padded = _dim0_shard(t.shape, n) * n
        elif layout == S.PER_PARAM_NUMEL:
            padded = ceil_div(t.numel, n) * n
        else:
            padded = t.numel
        per_block[t.block] = per_block.get(t.block, 0) + padded
        largest[t.block == ROOT_BLOCK] = max(largest[t.block == ROOT_BLOCK], padded)
        if t.block == ROOT_BLOCK and (seen_block or t.tied_names):
            root_head += padded
    if layout == S.FLAT_PER_BLOCK:
        per_block = {b: round_up(v, n) for b, v in per_block.items()}
    root = per_block.pop(ROOT_BLOCK, 0)
    blocks = tuple(per_block.values())
    return GatherSizes(largest_block=max(blocks, default=root), root=root, total_blocks=sum(blocks),
                       block_numels=blocks, total_sharded=inv.num_params, root_head=root_head,
                       largest_tensor=largest[False], root_largest_tensor=largest[True], tied=tied,
                       head_largest_tensor=head_largest)


def ceil_sum(numels: tuple[int, ...], r: int) -> int:
    return sum(ceil_div(b, r) for b in numels)


@dataclass(frozen=True)
class Zero3Schedule:
    """Elements of gathered (unsharded, non-persistent) parameters during a ZeRO-3 step, by phase."""

    forward: int  #: most gathered at once in forward, the coalesced all-gathers' flat buffers included
    forward_end: int  #: gathered while the last module of forward runs (when the loss's activations peak)
    loss: int  #: gathered when the loss backward runs (what the forward kept)
    backward: int  #: most gathered while the last block is in backward (kept + fetched + prefetched)
    end: int  #: most gathered in the rest of backward
    #: most gathered while a block's module runs in backward (the head's, released after its backward, not)
    blocks: int = 0


def zero3_schedule(inv: ParamInventory, n: int, prefetch: int, max_live: int, max_reuse: int,
                   threshold: int) -> Zero3Schedule:
    return _cached(inv, ("zero3", n, prefetch, max_live, max_reuse, threshold),
                   lambda: _zero3_schedule(inv, n, prefetch, max_live, max_reuse, threshold))


def _zero3_schedule(inv: ParamInventory, n: int, prefetch: int, max_live: int, max_reuse: int,
                    threshold: int) -> Zero3Schedule:
    """Replays DeepSpeed's PartitionedParameterCoordinator (deepspeed/runtime/zero/partitioned_param_coordinator.py,
    0.19) over the module trace of one step, once the trace is complete (every step after the first):

    - the trace is the modules in execution order, forward then backward (reversed); a tied weight's second
      module (lm_head) runs at the end of forward. Modules are the inventory's tensors grouped by owner, in
      order.
    - fetch_sub_module: gather the module's parameters that are not available; pop them from the parameter
      queue; then prefetch from the queue up to min(stage3_max_live_parameters - available, prefetch bucket)
      elements (a param popped while available is marked as used again at that later step).
    - release_sub_module / __params_to_release: release the module's parameters except the persistent ones
      (numel <= stage3_param_persistence_threshold), those the prefetcher saw reused later, and those used
      again by a module within stage3_max_reuse_distance elements of traversal after this one.
    - all_gather_coalesced (partition_parameters.py, _all_gather_dtype + AllGatherCoalescedHandle.wait) gathers
      a group into one flat buffer, then copies each parameter out of it (torch.cat): while a group of more
      than one parameter is waited on, its flat buffer and the copies coexist.
    - stage3.py step() releases everything (partition_all_parameters), and reset_step() zeroes the available
      count at the next forward.
    """
    import bisect
    from collections import deque

    tensors = inv.tensors
    numel = [t.numel for t in tensors]
    persist = [t.numel <= threshold for t in tensors]
    modules: dict[str, list[int]] = {}
    for i, t in enumerate(tensors):
        modules.setdefault(t.name.rsplit(".", 1)[0], []).append(i)
    for i, t in enumerate(tensors):
        for alias in t.tied_names:
            modules.setdefault("tied:" + alias.rsplit(".", 1)[0], []).append(i)
    fwd = list(modules.values())
    block_of = [tensors[m[0]].block for m in fwd]
    trace = fwd + fwd[::-1]
    nf = len(fwd)
    prefix = [0]
    for m in trace:
        prefix.append(prefix[-1] + sum(numel[p] for p in m))
    # next use of each parameter after each step
    next_use: list[dict[int, int]] = [{} for _ in trace]
    last: dict[int, int] = {}
    for k in range(len(trace) - 1, -1, -1):
        for p in trace[k]:
            next_use[k][p] = last.get(p, 1 << 62)
        for p in trace[k]:
            last[p] = k
    queue = deque((p, k) for k, m in enumerate(trace) for p in sorted(m))
    most_recent: dict[int, int] = {}
    avail: set[int] = set()  # AVAILABLE or INFLIGHT (what DeepSpeed counts in __n_available_params)
    copied: set[int] = set()  # the parameter's own unsharded tensor exists
    n_avail = 0
    copies = 0  # elements of unsharded parameter tensors
    flats: dict[int, int] = {}  # coalesced group -> elements of its flat all-gather buffer
    members: dict[int, set[int]] = {}  # coalesced group -> params still in the in-flight registry
    group_of: dict[int, int] = {}
    waited: set[int] = set()
    at_step: list[int] = []
    settled: list[int] = []  # after the waits' flat buffers are freed and the prefetch is issued
    after_release: list[int] = []

    def gather(ps: list[int], gid: int) -> None:
        # one all_gather_coalesced call: a single parameter is gathered straight into its own (padded) buffer;
        # several go through one flat buffer that lives while any of them is still in the in-flight registry
        nonlocal n_avail, copies
        avail.update(ps)
        n_avail += sum(numel[p] for p in ps)
        if len(ps) == 1:
            copied.add(ps[0])
            copies += numel[ps[0]]
            return
        flats[gid] = sum(ceil_div(numel[p], n) for p in ps) * n
        members[gid] = set(ps)
        for p in ps:
            group_of[p] = gid

    for k, params in enumerate(trace):
        to_fetch = [p for p in dict.fromkeys(params) if not persist[p] and p not in avail]
        if to_fetch:
            gather(to_fetch, 2 * k)
        for p in params:  # wait: the first wait on a group copies every member out of its flat buffer
            gid = group_of.pop(p, None)
            if gid is None:
                continue
            if gid not in waited:
                waited.add(gid)
                fresh_copies = [q for q in members[gid] | {p} if q in avail and q not in copied]
                copied.update(fresh_copies)
                copies += sum(numel[q] for q in fresh_copies)
            members[gid].discard(p)
        peak = copies + sum(flats.values())
        for gid in [g for g, m in members.items() if not m]:
            del members[gid], flats[gid]
        fresh = {p for p in params if most_recent.get(p, -1 << 62) < k}
        for _ in range(len(fresh)):
            if not queue:
                break
            p, step = queue.popleft()
            most_recent[p] = step
        if prefetch > 0:
            budget = min(max_live - n_avail, prefetch)
            picked: list[int] = []
            got = 0
            while queue and got < budget:
                p, step = queue.popleft()
                most_recent[p] = max(most_recent.get(p, -1 << 62), step)
                if not persist[p] and p not in avail and p not in picked:
                    picked.append(p)
                    got += numel[p]
            if picked:
                gather(picked, 2 * k + 1)
        settled.append(copies + sum(flats.values()))
        at_step.append(max(peak, settled[-1]))
        # release after the module ran (step_id is now k + 1)
        end = bisect.bisect_left(prefix, prefix[k + 1] + max_reuse, lo=k + 1) if max_reuse > 0 else k + 1
        for p in set(params):
            if persist[p] or p not in avail or most_recent.get(p, -1 << 62) > k + 1 or next_use[k][p] < end:
                continue
            avail.discard(p)
            n_avail -= numel[p]
            if p in copied:
                copied.discard(p)
                copies -= numel[p]
        after_release.append(copies + sum(flats.values()))

    # the backward phase the engine names "backward" runs until the last block's modules are done
    last_block = next((b for b in reversed(block_of) if b != ROOT_BLOCK), ROOT_BLOCK)
    cut = max((k for k in range(nf, 2 * nf) if block_of[2 * nf - 1 - k] == last_block), default=2 * nf - 1)
    first_block_bwd = range(nf, cut + 1)
    rest = range(cut + 1, 2 * nf)
    return Zero3Schedule(forward=max(at_step[:nf], default=0), forward_end=settled[nf - 1] if nf else 0,
                         loss=max(after_release[nf - 1], at_step[nf]) if nf else 0,
                         backward=max((at_step[k] for k in first_block_bwd), default=0),
                         end=max((at_step[k] for k in rest), default=0),
                         blocks=max((at_step[k] for k in range(nf, 2 * nf) if block_of[2 * nf - 1 - k] != ROOT_BLOCK),
                                    default=0))
