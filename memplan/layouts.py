"""Per-rank sizes that follow from how a strategy lays tensors out (see the layout constants in strategies.py).

Computed once per (inventory, layout, shard count) and cached: a 405B inventory has ~1,100 tensors, and the
planner evaluates many configurations of the same model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from memplan import strategies as S
from memplan.model.inventory import HEAD_PREFIXES, ROOT_BLOCK, ParamInventory, ParamTensor
from memplan.precision import Optimizer, Recipe
from memplan.precision import state_bytes as precision_state_bytes
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
    #: FSDP1's flat parameters, measured with the harness): max over i of n[i-1] + 2 n[i]
    single_step_scratch: int
    persistent_numel: int  #: ZeRO-3 params kept whole (numel <= persistence threshold), elements
    matmul_numel: int  #: weights read by matmuls (autocast casts these), elements
    #: the tensors the worst rank's optimizer steps, as the layout hands them to it: (their shape, elements) each.
    #: Whole tensors when replicated or placed whole (ZeroRedundancyOptimizer); FSDP2's dim-0 shards keep their
    #: other dims; DeepSpeed ZeRO-1/2's one flat fp32 partition (stage_1_and_2.py
    #: single_partition_of_fp32_groups); ZeRO-3's 1-D partitions, which its framework model flattens per
    #: sub-group (stage3.py _create_fp32_partitions); FSDP1's FlatParameter shard per unit
    #: (use_orig_params=False). What Adafactor factors and bitsandbytes quantizes depends on it.
    shard_shapes: tuple[tuple[tuple[int, ...], int], ...]
    #: ZeRO-1/2 (flat aligned): the most elements, over ranks, of the whole parameters that overlap a rank's
    #: partition; stage_1_and_2.py sizes grads_in_partition as sum(p.numel() for p in params_in_partition)
    partition_params_numel: int = 0
    #: gradient elements a rank holds where gradients are sharded as the parameters are (FSDP, ZeRO-3): its
    #: shard of the trainable parameters (-1: the same as shard_numel, nothing frozen)
    trainable_shard_numel: int = -1

    @property
    def grad_shard_numel(self) -> int:
        return self.shard_numel if self.trainable_shard_numel < 0 else self.trainable_shard_numel


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
    #: padded elements of the root's tensors between two stacks of blocks (a vision-language model's projector and
    #: language-model embedding, a decoder's position embedding): used at the later stack's input, their grads
    #: exist from the end of its backward on, through the earlier stack's
    root_between: int = 0
    #: padded elements of the largest single tensor in a layer block, and in the root
    largest_tensor: int = 0
    root_largest_tensor: int = 0
    #: elements of tied tensors (a tied embedding), and of the largest untied root tensor used after the blocks
    #: (the head), unpadded
    tied: int = 0
    head_largest_tensor: int = 0
    #: padded elements of each layer block's trainable parameters, the blocks as in block_numels (() : the same
    #: as block_numels, nothing frozen): what a block's gradients and reduce-scatter input hold under LoRA
    trainable_block_numels: tuple[int, ...] = ()
    #: expert parallelism (ParamTensor.shard_split): per layer block, the padded elements of its experts (the
    #: experts module is its own FSDP2 unit, over its own shard group), the shard elements of the whole block and
    #: of its experts (each tensor over its own group), the experts' shard group, and the largest expert tensor;
    #: () and 0 without
    block_experts: tuple[int, ...] = ()
    block_shards: tuple[int, ...] = ()
    block_expert_shards: tuple[int, ...] = ()
    block_expert_numels: tuple[int, ...] = ()  #: the experts' elements per block, unpadded
    expert_world: int = 0
    largest_expert_tensor: int = 0
    #: the experts are sharded on dim 1 (shard_dim: more expert-FSDP ranks than local experts)
    experts_on_dim1: bool = False
    #: elements of each layer block's trainable parameters, unpadded: what its unsharded gradients hold (FSDP2's
    #: unsharded parameter is an as_strided view of the padded all-gather output at its original size, so
    #: autograd's gradient is the original size); () : the same as grad_block_numels
    unpadded_grad_block_numels: tuple[int, ...] = ()

    @property
    def grad_block_numels(self) -> tuple[int, ...]:
        return self.trainable_block_numels or self.block_numels

    @property
    def unsharded_grad_block_numels(self) -> tuple[int, ...]:
        return self.unpadded_grad_block_numels or self.grad_block_numels


_cache: dict[tuple[Any, ...], tuple[ParamInventory, Any]] = {}
_T = TypeVar("_T")


def cached(inv: ParamInventory, key: tuple[Any, ...], make: Callable[[], _T]) -> _T:
    """``make()``, kept per inventory and key (a search asks for the same sizes at every GPU count)."""
    k = (id(inv),) + key
    hit = _cache.get(k)
    if hit is not None and hit[0] is inv:
        return cast(_T, hit[1])
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


def tensor_group(t: ParamTensor, n: int) -> int:
    """The FSDP shard group of one tensor in a data-parallel group of n (ParamTensor.shard_split)."""
    return n if t.shard_split == 1 else max(1, n // t.shard_split)


def shard_dim(t: ParamTensor, n: int) -> int:
    """The dim FSDP2 shards a tensor on over its group of n: 0 (fully_shard's default Shard(0)), or 1 for an
    expert-parallel rank's stacked experts when the group outnumbers them: torchtitan's apply_fsdp
    (torchtitan/distributed/fsdp.py: ``expert_shard_placement = Shard(1) if efsdp x ep > num_experts``, i.e. more
    expert-FSDP ranks than the rank's local experts), which shards each expert's rows instead of padding dim 0 to a
    row per rank."""
    return 1 if t.shard_split > 1 and len(t.shape) >= 3 and t.shape[0] < n else 0


def _dim0_shard(shape: tuple[int, ...], n: int, dim: int = 0) -> int:
    """Elements of one rank's shard of a tensor sharded on ``dim`` over n ranks (the dim padded to n)."""
    if not shape:
        return 1
    rest = 1
    for i, d in enumerate(shape):
        if i != dim:
            rest *= d
    return ceil_div(shape[dim], n) * rest


def tied_to_head(t: ParamTensor) -> bool:
    """A tensor tied to the output head (a causal LM's embedding tied to lm_head): its gradient's first contribution
    is the head's, from the start of backward. One tied only to other embeddings (T5's and BART's shared embedding
    under a classification head, or T5 v1.1's untied head) gets its first from an embedding's backward."""
    return any(a.lower().startswith(HEAD_PREFIXES) for a in t.tied_names)


def dim_shard(t: ParamTensor, n: int) -> int:
    """Elements of one rank's FSDP2 shard of ``t`` over exactly n ranks, on the dim it is sharded on there
    (shard_dim; that dim padded to n)."""
    return _dim0_shard(t.shape, n, shard_dim(t, n))


def _tensor_shard(t: ParamTensor, n: int) -> int:
    """Elements of one rank's FSDP2 shard of ``t`` in a data-parallel group of n (its own group: _group; its
    shard dim: shard_dim)."""
    g = tensor_group(t, n)
    return _dim0_shard(t.shape, g, shard_dim(t, g))


def _local_dim0(shape: tuple[int, ...], part: int, dim: int = 0) -> tuple[int, ...]:
    """The shape of a shard of ``part`` elements on ``dim`` (FSDP2's padded local tensor)."""
    if len(shape) < 2:
        return (part,) if shape else ()
    rest = 1
    for i, d in enumerate(shape):
        if i != dim:
            rest *= d
    return tuple((part // rest if rest else 0) if i == dim else d for i, d in enumerate(shape))


def layout_sizes(inv: ParamInventory, layout: str, n: int, persistence_threshold: int = 0) -> LayoutSizes:
    make = _with_frozen if inv.frozen else _layout_sizes
    return cached(inv, ("layout", layout, n, persistence_threshold),
                  lambda: make(inv, layout, n, persistence_threshold))


def _with_frozen(inv: ParamInventory, layout: str, n: int, threshold: int) -> LayoutSizes:
    """A model with frozen parameters (LoRA): every framework stores them as it stores the others, but gives
    gradients, reduce buffers and optimizer states to the trainable ones only:
    - DDP's reducer buckets and torch.optim's states cover parameters that require grad
      (torch/nn/parallel/distributed.py _build_params_for_reducer; Adam makes state only for p.grad);
    - FSDP2 shards every parameter and reduce-scatters those with a gradient (_fsdp_param_group.py
      foreach_reduce over fsdp_params_with_grad);
    - DeepSpeed ZeRO-1/2 flattens and partitions only the trainable parameters
      (stage_1_and_2.py: trainable_parameters = [p for p in param_group['params'] if p.requires_grad]); the frozen
      ones stay whole module parameters, cast to the 16-bit dtype like the rest (engine.py module.bfloat16());
    - ZeRO-3 partitions every parameter (zero.Init / _convert_to_zero_parameters) and builds its fp16 and fp32
      groups from the trainable ones (stage3.py _get_trainable_parameter_groups)."""
    full = _layout_sizes(inv, layout, n, threshold)
    tr = _layout_sizes(inv.trainable_inventory, layout, n, threshold)
    shard = full.shard_numel
    if layout == S.FLAT_ALIGNED:
        shard = tr.shard_numel + inv.num_params - inv.trainable_params
    return LayoutSizes(shard, tr.optimizer_numel, tr.single_step_scratch, full.persistent_numel, full.matmul_numel,
                       tr.shard_shapes, tr.partition_params_numel, trainable_shard_numel=tr.shard_numel)


def _layout_sizes(inv: ParamInventory, layout: str, n: int, threshold: int) -> LayoutSizes:
    tensors = inv.tensors
    numels = inv.numels
    psi = inv.num_params
    matmul = sum(x for t, x in zip(tensors, numels) if len(t.shape) >= 2 and (t.category != "embedding" or t.tied_names))
    persistent = 0
    partition_params = 0
    if layout == S.REPLICATED:
        shard = opt = psi
        shapes = tuple((t.shape, x) for t, x in zip(tensors, numels))
        largest = _pairs(list(numels))
    elif layout == S.FLAT_ALIGNED:
        # every rank keeps the whole (padded) bf16 flat buffer; master, states and fp32 grads are partitioned
        shard = round_up(psi, DS_NCCL_START_ALIGNMENT_FACTOR * n)
        opt = shard // n
        shapes = (((opt,), opt),)
        largest = 2 * opt  # the optimizer steps on one flat fp32 partition
        # a parameter belongs to every partition its elements overlap (the flat buffer holds them in order): the
        # most a partition holds, as range additions swept in partition order
        changes: dict[int, int] = {}
        start = 0
        for x in numels:
            if x:
                first, last = start // opt, min(n - 1, (start + x - 1) // opt)
                changes[first] = changes.get(first, 0) + x
                changes[last + 1] = changes.get(last + 1, 0) - x
            start += x
        running = partition_params = 0
        for k in sorted(changes):
            running += changes[k]
            partition_params = max(partition_params, running)
    elif layout == S.PER_PARAM_NUMEL:
        parts = [ceil_div(x, n) for x in numels]
        shard = opt = sum(parts)
        persistent = sum(x for x in numels if x <= threshold)
        shapes = tuple(((p,), p) for p in parts)
        largest = 2 * opt  # fp32 partitions are flattened per sub group (sub_group_size 1e9 by default)
    elif layout == S.PER_PARAM_DIM0:
        parts = [_tensor_shard(t, n) for t in tensors]
        shard = opt = sum(parts)
        shapes = tuple((_local_dim0(t.shape, p, shard_dim(t, tensor_group(t, n))), p) for t, p in zip(tensors, parts))
        largest = _pairs(parts)
    elif layout == S.FLAT_PER_BLOCK:
        parts = [round_up(u, n) // n for u in _unit_numels(inv).values() if u]
        shard = opt = sum(parts)
        shapes = tuple(((p,), p) for p in parts)
        largest = _pairs(parts)  # the root's first
    elif layout == S.FLAT_WHOLE:
        shard = opt = round_up(psi, n) // n
        shapes = (((shard,), shard),)
        largest = 2 * shard
    elif layout == S.GREEDY_WHOLE:
        # ZeroRedundancyOptimizer._partition_parameters: sorted by numel (stable, largest first), each to the
        # first rank with the smallest total so far; the worst rank is predicted.
        # ``sizes.index(min(sizes))`` is the smallest (total, rank): a heap of the ranks given something, and the
        # lowest rank given nothing yet (every such rank totals 0), so a million ranks cost what eight do
        members, worst = greedy_whole(list(numels), n)
        shard, opt = psi, sum(numels[i] for i in members)
        shapes = tuple((tensors[i].shape, numels[i]) for i in members)
        largest = _pairs([numels[i] for i in members])  # its params, largest first
    else:  # pragma: no cover - the strategy table only uses the layouts above
        raise ValueError(f"unknown layout {layout}")
    return LayoutSizes(shard, opt, largest, persistent, matmul, shapes, partition_params)


def greedy_whole(numels: list[int], n: int) -> tuple[list[int], int]:
    """ZeroRedundancyOptimizer._partition_parameters over ``n`` ranks: (the worst rank's tensor indices, largest
    first; that rank). Each tensor, largest first (a stable sort), goes to ``sizes.index(min(sizes))``: the
    smallest total, the lowest rank among equals; the worst rank is ``sizes.index(max(sizes))``."""
    import heapq

    heap: list[tuple[int, int]] = []  # (total, rank) of the ranks given a tensor
    unused = 0  # the lowest rank given nothing (all of them total 0)
    members: dict[int, list[int]] = {}
    totals: dict[int, int] = {}
    for i in sorted(range(len(numels)), key=lambda j: numels[j], reverse=True):
        if unused < n and (not heap or (0, unused) < heap[0]):
            r, unused = unused, unused + 1
        else:
            r = heapq.heappop(heap)[1]
        totals[r] = totals.get(r, 0) + numels[i]
        members.setdefault(r, []).append(i)
        heapq.heappush(heap, (totals[r], r))
    if not totals:
        return [], 0
    top = max(totals.values())
    worst = min(r for r, v in totals.items() if v == top)
    if top == 0 and unused < n:  # every rank totals 0: the first is the worst
        worst = 0
    return members.get(worst, []), worst


def _unit_numels(inv: ParamInventory) -> dict[str, int]:
    """Elements of each FSDP1 FlatParameter: one per unit (ParamTensor.unit where a size-based policy set it, else
    the block), the root's first (FSDP1's root unit is made last, but its optimizer sees model.parameters(); the
    order only moves the single-tensor step's scratch pair)."""
    out: dict[str, int] = {ROOT_BLOCK: 0}
    for t in inv.tensors:
        key = t.unit or t.block
        key = ROOT_BLOCK if key.endswith("<root>") else key
        out[key] = out.get(key, 0) + t.numel
    return out


def optimizer_state_bytes(opt: Optimizer, recipe: Recipe, lay: LayoutSizes,
                          tensors: tuple[tuple[tuple[int, ...], int], ...]) -> int:
    """Optimizer-state bytes on the worst rank, ``tensors`` what its optimizer steps (FrameworkModel.
    optimizer_tensors). Adam/SGD: states x elements, whatever the shapes."""
    if not opt.shape_dependent:
        return opt.states_per_param * (opt.state_bytes_override or recipe.state_bytes) * lay.optimizer_numel
    return precision_state_bytes(opt, recipe, tensors)


def gather_sizes(inv: ParamInventory, layout: str, n: int) -> GatherSizes:
    return cached(inv, ("gather", layout, n), lambda: _gather_sizes(inv, layout, n))


def _gather_sizes(inv: ParamInventory, layout: str, n: int) -> GatherSizes:
    """Gathered sizes by group (ParamTensor.group: the block, or the root group for the root and any unit above
    the blocks). A root-group tensor of a block (a size-based unit above the blocks holds it) counts with the
    head's: its gradient is made in its block's backward and kept to that unit's reduce after all of them, so
    from the head's backward on is its upper bound. The head's side of the root is what follows the last block
    (and anything tied): a root tensor between two stacks of blocks (a vision-language model's projector and
    input embedding, an encoder's final norm) gets its gradient after the later stack's backward, not with the
    head's."""
    per_block: dict[str, int] = {}
    per_block_trainable: dict[str, int] = {}
    per_block_grad: dict[str, int] = {}  # trainable elements, unpadded
    root_head = tied = head_largest = 0
    largest = {True: 0, False: 0}  # root?: the largest padded tensor
    last_block = max((i for i, t in enumerate(inv.tensors) if t.block != ROOT_BLOCK), default=-1)
    first_block = next((i for i, t in enumerate(inv.tensors) if t.block != ROOT_BLOCK), -1)
    root_between = 0
    units: dict[tuple[str, str], list[int]] = {}  # FLAT_PER_BLOCK: (group, unit) -> [elements, trainable]
    # expert parallelism: group -> [expert elements, block shard, expert shard, expert elements unpadded]
    experts: dict[str, list[int]] = {}
    expert_world = largest_expert = 0
    on_dim1 = False
    has_ep = any(t.shard_split > 1 for t in inv.tensors)
    two_stacks = len({b.name.rpartition(".")[0] for b in inv.layer_blocks}) > 1
    for i, t in enumerate(inv.tensors):
        group = t.group
        if t.tied_names:
            tied += t.numel
        elif t.block == ROOT_BLOCK and i > last_block:
            head_largest = max(head_largest, t.numel)
        if layout == S.PER_PARAM_DIM0:
            padded = _tensor_shard(t, n) * tensor_group(t, n)
            if has_ep:
                row = experts.setdefault(group, [0, 0, 0, 0])
                row[1] += padded // tensor_group(t, n)
                if t.shard_split > 1:
                    row[0] += padded
                    row[2] += padded // tensor_group(t, n)
                    row[3] += t.numel
                    expert_world = tensor_group(t, n)
                    largest_expert = max(largest_expert, padded)
                    on_dim1 = on_dim1 or shard_dim(t, expert_world) == 1
        elif layout == S.PER_PARAM_NUMEL:
            padded = ceil_div(t.numel, n) * n
        else:
            padded = t.numel
        if layout == S.FLAT_PER_BLOCK:
            u = units.setdefault((group, t.unit or t.block), [0, 0])
            u[0] += padded
            u[1] += padded if t.trainable else 0
        per_block[group] = per_block.get(group, 0) + padded
        per_block_trainable[group] = per_block_trainable.get(group, 0) + (padded if t.trainable else 0)
        per_block_grad[group] = per_block_grad.get(group, 0) + (t.numel if t.trainable else 0)
        largest[group == ROOT_BLOCK] = max(largest[group == ROOT_BLOCK], padded)
        if group == ROOT_BLOCK and (i > last_block or t.block != ROOT_BLOCK or tied_to_head(t)):
            root_head += padded
        elif group == ROOT_BLOCK and (first_block < i < last_block or (t.tied_names and two_stacks)):
            # between two stacks: used at the later stack's input, or tied to an embedding there (an
            # encoder-decoder's shared embedding under a head of its own: its first gradient contribution is the
            # decoder's embedding's backward, after the decoder's blocks)
            root_between += padded
    if layout == S.FLAT_PER_BLOCK:  # each unit's FlatParameter padded to the shard group
        per_block = {b: 0 for b in per_block}
        per_block_trainable = {b: 0 for b in per_block}
        for (b, _), (numel, trainable) in units.items():
            per_block[b] += round_up(numel, n)
            per_block_trainable[b] += round_up(trainable, n)
    root = per_block.pop(ROOT_BLOCK, 0)
    per_block_trainable.pop(ROOT_BLOCK, 0)
    per_block_grad.pop(ROOT_BLOCK, 0)
    grad_blocks = tuple(per_block_grad.get(b, 0) for b in per_block)
    blocks = tuple(per_block.values())
    ep: dict[str, Any] = {}
    if expert_world:
        rows = [experts.get(b, [0, 0, 0, 0]) for b in per_block]
        ep = dict(block_experts=tuple(r[0] for r in rows), block_shards=tuple(r[1] for r in rows),
                  block_expert_shards=tuple(r[2] for r in rows), block_expert_numels=tuple(r[3] for r in rows),
                  expert_world=expert_world,
                  largest_expert_tensor=largest_expert, experts_on_dim1=on_dim1)
    trainable_blocks = tuple(per_block_trainable.values()) if inv.frozen else ()
    return GatherSizes(largest_block=max(blocks, default=root), root=root, total_blocks=sum(blocks),
                       block_numels=blocks, total_sharded=inv.num_params, root_head=root_head,
                       root_between=root_between,
                       largest_tensor=largest[False], root_largest_tensor=largest[True], tied=tied,
                       head_largest_tensor=head_largest, trainable_block_numels=trainable_blocks,
                       unpadded_grad_block_numels=grad_blocks if layout == S.PER_PARAM_DIM0 else (), **ep)


def ceil_sum(numels: tuple[int, ...], r: int) -> int:
    return sum(ceil_div(b, r) for b in numels)

