"""Pipeline parallelism (PP): the stages each pipeline rank holds (torchtitan's split, DeepSpeed's
partition_balanced), its share of the model, the micro-batches it holds in flight, and its send and receive
buffers. The schedules' action lists are memplan/parallel/schedules.py."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from memplan.model.inventory import ROOT_BLOCK, ParamInventory, ParamTensor
from memplan.parallel import schedules
from memplan.parallel.degrees import MEGATRON_DEEPSPEED, Parallel, TORCHTITAN
from memplan.parallel.sequence import sp_split, sp_tokens
from memplan.parallel.tensor import padded_vocab, tp_inventory
from memplan.precision import Recipe


@dataclass(frozen=True)
class Chunk:
    """One pipeline stage (a virtual stage under interleaving): its blocks, and whether it holds the embedding
    (first) or the final norm and the head (last)."""

    layers: tuple[int, ...]
    first: bool
    last: bool


def torchtitan_stages(num_stages: int, layers: int) -> list[Chunk]:
    """torchtitan's generate_llm_fqn_per_model_part(num_stages, layers, input_weight=1, output_weight=1)."""
    if num_stages == 1:
        return [Chunk(tuple(range(layers)), True, True)]
    effective = layers + 2
    per, extra = divmod(effective, num_stages)
    out, cur = [], 0
    for i in range(num_stages):
        n = per + (1 if i < extra else 0) - (1 if i in (0, num_stages - 1) else 0)
        take = tuple(range(cur, min(cur + max(n, 0), layers)))
        cur += len(take)
        out.append(Chunk(take, i == 0, i == num_stages - 1))
    return out


def partition_balanced(weights: list[int], parts: int) -> list[int]:
    """DeepSpeed's partition_balanced (deepspeed/runtime/utils.py, 0.19.8): the linear partition minimising
    max - min of the parts' sums, ties to the later split; boundaries, parts + 1 of them."""
    return list(_partition_balanced(tuple(weights), parts))


@lru_cache(maxsize=256)
def _partition_balanced(weights: tuple[int, ...], parts: int) -> tuple[int, ...]:
    n, m = len(weights), parts
    if n <= m:
        return tuple(min(p, n) for p in range(m + 1))
    inf = float("inf")
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    pos = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + w
    dp_max[0][0] = dp_cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                s = prefix[i] - prefix[k]
                hi, lo = max(dp_max[k][j - 1], s), min(dp_min[k][j - 1], s)
                if dp_cost[i][j] >= hi - lo:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j], pos[i][j] = hi - lo, hi, lo, k
    out = [n]
    for i in range(m, 0, -1):
        out.append(pos[out[-1]][i])
    return tuple(out[::-1])


def _layer_sizes(inv: ParamInventory) -> tuple[int, list[int], int]:
    """(embedding, per block, final norm + head) trainable elements, as PipelineModule's layers count them."""
    index = {b.name: i for i, b in enumerate(inv.layer_blocks)}
    blocks = [0] * len(index)
    emb = head = 0
    for t in inv.tensors:
        if not t.trainable:
            continue
        if t.block != ROOT_BLOCK:
            blocks[index[t.block]] += t.numel
        elif _at_end(t):
            head += t.numel
        else:
            emb += t.numel
            if t.tied_names:  # a tied head is the embedding again on the last stage (TiedLayerSpec)
                head += t.numel
    return emb, blocks, head


def _at_end(t: ParamTensor) -> bool:
    """A root tensor of the last stage (the final norm, the head); the others go with the embedding."""
    return t.category in ("head", "norm")


def rank_chunks(p: Parallel, layout: str, inv: ParamInventory) -> list[list[Chunk]]:
    """Per pipeline rank, its stages in the order it runs them."""
    layers = len(inv.layer_blocks)
    if p.pp == 1:
        return [[Chunk(tuple(range(layers)), True, True)]]
    if layout == TORCHTITAN:
        v = p.virtual if p.multi_stage else 1
        stages = torchtitan_stages(p.pp * v, layers)
        return [[stages[i] for i in ids] for ids in schedules.rank_stages(p.schedule, p.pp, v)]
    emb, blocks, head = _layer_sizes(tp_inventory(inv, p, layout))
    weights = [emb] + blocks + [head]
    bounds = partition_balanced(weights, p.pp)
    out = []
    for r in range(p.pp):
        lo, hi = bounds[r], bounds[r + 1]
        out.append([Chunk(tuple(i - 1 for i in range(lo, hi) if 1 <= i <= layers), lo == 0, hi == len(weights))])
    return out


def in_flight(p: Parallel, layout: str, rank: int, micro_batches: int) -> int:
    """Micro-batches (stages' micro-batches on a rank running several stages) whose activations a pipeline rank
    holds at once, the one in its backward included: the most at any backward of its action list
    (memplan/parallel/schedules.py, torch's schedules; Megatron's forward_backward_pipelining_without_interleaving and
    DeepSpeed's TrainSchedule, num_pipe_buffers min(stages - stage_id, micro_batches), hold what torch's 1F1B
    does)."""
    if p.pp == 1:
        return 1
    if layout == MEGATRON_DEEPSPEED:
        return min(micro_batches, p.pp - rank)
    return max(sum(held) for held, _, _ in held_moments(p, rank, micro_batches))


def held_moments(p: Parallel, rank: int, micro_batches: int) -> list[tuple[tuple[int, ...], int, str]]:
    """Each backward of a rank of the torchtitan layout (memplan/parallel/schedules.py held_moments)."""
    return schedules.held_moments(p.schedule, p.pp, micro_batches, p.virtual, rank)


def backward_moments(p: Parallel, rank: int, micro_batches: int
                     ) -> list[tuple[tuple[int, ...], int, str, tuple[bool, ...]]]:
    """held_moments with the local stages accumulated before each (memplan/parallel/schedules.py)."""
    return schedules.backward_moments(p.schedule, p.pp, micro_batches, p.virtual, rank)


def stage_inventory(inv: ParamInventory, chunks: list[Chunk]) -> ParamInventory:
    """The tensors a pipeline rank holds: its chunks' blocks, the embedding where it runs the first stage, the
    final norm and the head where it runs the last (a tied embedding on both: Megatron and DeepSpeed's
    TiedLayerSpec keep a copy on each end; torchtitan's models are untied)."""
    keep = {i for c in chunks for i in c.layers}
    first, last = any(c.first for c in chunks), any(c.last for c in chunks)
    names = {b.name: i for i, b in enumerate(inv.layer_blocks)}
    tensors = []
    for t in inv.tensors:
        if t.block != ROOT_BLOCK:
            if names[t.block] in keep:
                tensors.append(t)
        elif _at_end(t):
            if last:
                tensors.append(t)
        elif first or (last and t.tied_names):
            tensors.append(replace(t, tied_names=()) if not first else t)
    dims = dict(inv.dims)
    dims["num_layers"] = max(len(c.layers) for c in chunks)
    # buffers: its blocks' own, and the root's on every stage (the rotary embedding each stage's model part keeps)
    buffers = tuple(b for b in inv.buffers if b.block == ROOT_BLOCK or names[b.block] in keep)
    return replace(inv, tensors=tuple(tensors), dims=dims, buffers=buffers)


@dataclass(frozen=True)
class RankShare:
    """One pipeline rank's share: its chunks, tensors, and micro-batches in flight."""

    rank: int
    chunks: tuple[Chunk, ...]
    inventory: ParamInventory
    in_flight: int

    @property
    def first(self) -> bool:
        return any(c.first for c in self.chunks)

    @property
    def last(self) -> bool:
        return any(c.last for c in self.chunks)

    @property
    def layers(self) -> int:
        """Blocks of its largest chunk (what one micro-batch's activations on the rank are traced for)."""
        return max(len(c.layers) for c in self.chunks)

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(i for c in self.chunks for i in c.layers)

    def describe(self) -> str:
        b = self.blocks
        def run(c: Chunk) -> str:
            return "-" if not c.layers else str(c.layers[0]) if len(c.layers) == 1 else \
                f"{c.layers[0]}-{c.layers[-1]}"

        span = "no blocks" if not b else f"block {b[0]}" if len(b) == 1 else (
            f"blocks {b[0]}-{b[-1]}" if len(self.chunks) == 1 else
            "blocks " + ", ".join(run(c) for c in self.chunks))
        ends = [x for x, on in (("embedding", self.first), ("head", self.last)) if on]
        return span + (f" + {' + '.join(ends)}" if ends else "")


_SHARES: dict[tuple[Any, ...], tuple[ParamInventory, tuple[RankShare, ...]]] = {}


def shares(inv: ParamInventory, p: Parallel, layout: str, micro_batches: int) -> tuple[RankShare, ...]:
    """Every pipeline rank's share (TP applied), in rank order (cached: a search asks for the same layout at
    every GPU count)."""
    key = (id(inv), p.tp, p.pp, p.vpp, p.ep, p.schedule, layout, micro_batches)
    hit = _SHARES.get(key)
    if hit is not None and hit[0] is inv:
        return hit[1]
    chunks = rank_chunks(p, layout, inv)
    tpi = tp_inventory(inv, p, layout)
    out = tuple(RankShare(r, tuple(c), stage_inventory(tpi, c), in_flight(p, layout, r, micro_batches))
                for r, c in enumerate(chunks))
    if len(_SHARES) > 256:
        _SHARES.clear()
    _SHARES[key] = (inv, out)
    return out


def dominated(shares: tuple[RankShare, ...]) -> set[int]:
    """Pipeline ranks no more loaded than another: the same stages' shapes (blocks of the same sizes, the same ends)
    with no more micro-batches in flight (1F1B's later middle ranks); their figures are never the most."""
    def shape(sh: RankShare) -> tuple[Any, ...]:
        return (tuple((tuple(sorted(b.numel for b in sh.inventory.layer_blocks)), c.first, c.last)
                      for c in sh.chunks[:1]) if len(sh.chunks) == 1 else id(sh),
                sh.first, sh.last, tuple(sorted((t.shape, t.trainable) for t in sh.inventory.tensors
                                                if t.block == ROOT_BLOCK)))
    best: dict[tuple[Any, ...], int] = {}
    for sh in shares:
        k = shape(sh)
        if k not in best or sh.in_flight > shares[best[k]].in_flight:
            best[k] = sh.rank
    keep = set(best.values())
    return {sh.rank for sh in shares if sh.rank not in keep}


def stage_output(dims: dict[str, Any], p: Parallel, layout: str, last: bool, recipe: Recipe) -> int:
    """Bytes per token of a pipeline stage's output that its in-flight micro-batches keep beyond what their
    blocks save (torch.distributed.pipelining's PipelineStage.fwd_cache holds each micro-batch's output until
    its backward): the last stage's logits in the compute dtype (the loss works on their fp32 copy); another
    stage's last hidden state in the residual dtype, unless fp32 (then the final norm of a whole model would
    have saved that very tensor; a stage without that norm keeps it here), split over the TP ranks under sequence
    parallelism."""
    if p.pp == 1:
        return 0
    if last:
        vocab: int = dims.get("vocab_size", 0)
        return recipe.compute_bytes * padded_vocab(vocab, p, layout)
    # the last block's output: under sequence parallelism the rank's share of the sequence (sp_tokens)
    hidden: int = dims.get("hidden_size", 0)
    return hidden * (recipe.residual_bytes if recipe.residual_bytes < 4 else 4) // sp_split(p)


def recv_buffers(dims: dict[str, Any], p: Parallel, share: RankShare, micro_batches: int, tokens: int,
                 recipe: Recipe, layout: str = TORCHTITAN) -> int:
    """A pipeline rank's receive buffers, made once for every micro-batch of a step and kept
    (torch/distributed/pipelining/stage.py _setup_forward_recv_info: a buffer per micro-batch for the
    activations a stage after the first receives; _create_grad_recv_info / _setup_backward_recv_info: one per
    micro-batch for the gradients a stage before the last receives); ``tokens`` per micro-batch. Each holds the
    hidden state between stages, [micro-batch, seq, hidden] in the residual dtype (its sequence split over the TP
    ranks under sequence parallelism: sp_tokens); measured on CPU (2 stages, 4 micro-batches of 2 x 128 tokens,
    hidden 256, bf16): 524,288 B on each rank from the first step on."""
    if p.pp == 1:
        return 0
    hidden: int = dims.get("hidden_size", 0)
    each = sp_tokens(tokens, p) * hidden * recipe.residual_bytes
    chunks = len(share.chunks)
    n = sum((0 if c.first else 1) + (0 if c.last else 1) for c in share.chunks) if chunks else 0
    if layout == MEGATRON_DEEPSPEED:
        # DeepSpeed's PipelineEngine keeps one of each (engine.py pipe_recv_buf, grad_layer) and clones each
        # received activation (_exec_recv_activations: pipe_recv_buf.clone()): the clones are in stage_input
        return n * each
    return n * micro_batches * each


def stage_input(dims: dict[str, Any], p: Parallel, layout: str, first: bool, recipe: Recipe) -> int:
    """Bytes per token of a received stage input each in-flight micro-batch keeps beyond the blocks' saved
    tensors: DeepSpeed's clone of its receive buffer (torch's pipelining receives into a buffer per micro-batch,
    counted in recv_buffers)."""
    if p.pp == 1 or first or layout != MEGATRON_DEEPSPEED:
        return 0
    hidden: int = dims.get("hidden_size", 0)
    return hidden * recipe.residual_bytes // sp_split(p)


def zero_bubble_grads(dims: dict[str, Any], layers: int, tokens: int, compute_bytes: int) -> int:
    """Bytes per micro-batch (of ``tokens`` tokens) that a zero-bubble schedule's input-gradient step keeps for its
    weight-gradient step, beyond a backward's: torch's stage_backward_input (torch/distributed/pipelining/
    _backward.py) computes the input's gradient with the graph retained and stores, per parameter group, the
    gradients flowing into the weight-gradient subgraphs (param_group["grads"]): of each linear's output, the
    q, k, v, o, gate, up and down projections' outputs of every block of the stage, in the compute dtype."""
    h: int = dims.get("hidden_size", 0)
    heads: int = dims.get("num_heads") or 1
    hd: int = dims.get("head_dim") or h // heads
    kv: int = dims.get("num_kv_heads") or heads
    inter: int = dims.get("intermediate_size", 4 * h)
    gated = dims.get("gated_mlp", 1)
    per_token = heads * hd + 2 * kv * hd + h + (2 if gated else 1) * inter + h
    return layers * tokens * per_token * compute_bytes
