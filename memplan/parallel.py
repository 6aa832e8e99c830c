"""Model parallelism: tensor (TP), sequence (SP) and pipeline (PP) parallelism, as the frameworks lay them out.

A job on ``gpus = dp x tp x pp`` GPUs runs its data-parallel strategy (DDP, ZeRO, FSDP2/HSDP) over the dp ranks
that hold the same share of the model. That share is a smaller model: the pipeline stage's blocks (with the
embedding on the first stage, the final norm and the head on the last) with every tensor-parallel linear cut to
its TP rank's rows or columns. This module computes that share per pipeline rank, exactly, as a ParamInventory the
engine sizes like any other model, and how many micro-batches each stage holds in flight. Pure Python: it imports
neither torch nor transformers.

Two layouts, chosen by the data-parallel strategy's framework:

- ``torchtitan`` (FSDP2, HSDP, DDP): DTensor tensor parallelism (torch.distributed.tensor.parallel: ColwiseParallel
  and RowwiseParallel on the attention and MLP projections, the embedding and the head split by vocabulary rows
  with torch.chunk's sizes, ceil(V / tp) on the first ranks), torch.distributed.pipelining's schedules, and
  torchtitan's stage split (torchtitan/distributed/pipeline_parallel.py generate_llm_fqn_per_model_part: the
  embedding and the head each count as one layer, the effective layers spread evenly, the first stages one more;
  looped virtual stages, rank r holding stages r, r + pp, ...; multi-stage schedules two per rank by default).
- ``megatron-deepspeed`` (DeepSpeed ZeRO-0/1, and ZeRO-2/3 without PP): Megatron's tensor-parallel layers
  (ColumnParallelLinear / RowParallelLinear; the vocabulary padded to a multiple of 128 x tp,
  megatron/training/tokenizer ``_vocab_size_with_padding``, make_vocab_size_divisible_by 128; key/value heads
  replicated when there are fewer of them than TP ranks) and DeepSpeed's PipelineEngine (1F1B only,
  deepspeed/runtime/pipe/schedule.py TrainSchedule; PipelineModule's default partition_method "parameters":
  deepspeed/runtime/utils.py partition_balanced over the layers' parameter counts, layers = [embedding, blocks...,
  final norm, head]; ZeRO-2 and -3 refused with PP, as engine.py's PipelineEngine asserts).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from memplan import pipeline
from memplan.errors import SettingsError
from memplan.inputs import quote
from memplan.model.inventory import ROOT_BLOCK, ParamInventory, ParamTensor
from memplan.units import ceil_div

#: torch.distributed.pipelining's schedules (memplan/pipeline.py; --schedule also takes torch's class names)
SCHEDULES = tuple(pipeline.TORCH_NAMES)
TORCHTITAN = "torchtitan"
MEGATRON_DEEPSPEED = "megatron-deepspeed"
#: the schedules each layout runs (torch.distributed.pipelining get_schedule_class: 1F1B, GPipe,
#: Interleaved1F1B; DeepSpeed's PipelineEngine: TrainSchedule, a 1F1B)
LAYOUT_SCHEDULES = {TORCHTITAN: SCHEDULES, MEGATRON_DEEPSPEED: ("1f1b",)}
#: a rank config's key (rank_config) telling the tracer to run one expert-parallel rank (memplan/substitutes.py
#: expert_parallel)
EP_KEY = "memplan_expert_parallel"
#: ... and one context-parallel rank (memplan/substitutes_sdpa.py _ring)
CP_KEY = "memplan_context_parallel"
#: Megatron's make_vocab_size_divisible_by default
MEGATRON_VOCAB_MULTIPLE = 128

#: projections split by output features (ColumnParallelLinear / ColwiseParallel), by the module's name
COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "c_attn",
                    "c_fc", "fc1", "query_key_value", "dense_h_to_4h", "w1", "w3", "wq", "wk", "wv", "wqkv",
                    "query", "key", "value", "Wqkv"})
#: projections split by input features (RowParallelLinear / RowwiseParallel); their bias stays whole
ROW = frozenset({"o_proj", "down_proj", "c_proj", "dense", "dense_4h_to_h", "fc2", "w2", "wo", "out_proj"})
KV = frozenset({"k_proj", "v_proj", "wk", "wv", "key", "value"})


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """The model-parallel degrees of a job (--tp, --pp, --vpp, --sp, --schedule)."""

    tp: int = 1
    pp: int = 1
    #: virtual stages per pipeline rank (interleaved); None: the layout's default (torchtitan: 2 when interleaved)
    vpp: int | None = None
    sp: bool = False  #: sequence parallelism: the norms' and residuals' activations split over the TP ranks
    schedule: str = "1f1b"
    #: torchtitan's loss parallelism (its default): the head's logits stay split by vocabulary and the loss runs
    #: on each rank's share; False: they are gathered whole first (torchtitan's disable_loss_parallel, and
    #: transformers' own tensor parallelism, which Accelerate's parallelism_config runs: the head's plan is
    #: colwise_gather_output)
    loss_parallel: bool = True
    #: expert parallelism: each MoE layer's routed experts split over ep ranks of the data-parallel x TP group
    #: (whole experts per rank, tokens exchanged by all-to-all); their FSDP2 group is the rest, efsdp =
    #: dp x tp / ep (torchtitan's dp_shard_mod_ep; transformers' DistributedConfig efsdp_size)
    ep: int = 1
    #: context parallelism: each rank of a cp group holds 1/cp of every sequence (torchtitan's load-balanced
    #: chunks) and runs ring attention over the group (torch's context_parallel); the parameters are sharded (or
    #: replicated) over dp x cp, as torchtitan folds cp into its FSDP mesh (dp_shard_cp)
    cp: int = 1
    #: the activation profiles options.py made for the ranks' shares: (with the loss, without it)
    profiles: Any = field(default=None, compare=False)

    @property
    def active(self) -> bool:
        return (self.tp, self.pp, self.ep, self.cp) != (1, 1, 1, 1)

    @property
    def model_ranks(self) -> int:
        return self.tp * self.pp

    @property
    def virtual(self) -> int:
        if self.schedule in pipeline.V_SHAPED:
            return 2  # ZB-V, DualPipeV: exactly two stages per rank, in a V
        # torchtitan's multi-stage schedules default to two stages per rank (pipeline_parallel.py
        # pipeline_module_split: stages_per_rank)
        return self.vpp or (2 if self.schedule in pipeline.MULTI_STAGE else 1)

    @property
    def multi_stage(self) -> bool:
        """A schedule that runs more than one stage per rank."""
        return self.schedule in pipeline.MULTI_STAGE


def layout_of(strategy: Any, pp: int) -> str:
    """The layout a data-parallel strategy runs model parallelism with; SettingsError for those none does."""
    if strategy.framework == "deepspeed":
        if pp > 1 and (strategy.zero_stage or 0) >= 2:
            raise SettingsError(f"--pp {pp} with ZeRO stage {strategy.zero_stage}: DeepSpeed's PipelineEngine takes "
                                "ZeRO stage 0 or 1 only (deepspeed/runtime/pipe/engine.py: \"ZeRO-2 and ZeRO-3 are "
                                "incompatible with pipeline parallelism\")")
        return MEGATRON_DEEPSPEED
    if strategy.framework == "fsdp2" or strategy.name == "ddp":
        return TORCHTITAN
    raise SettingsError(f"--tp/--pp/--cp/--ep with --strategy {strategy.name}: memplan models model parallelism "
                        "under FSDP2, HSDP and DDP (torchtitan's DTensor layout) and DeepSpeed ZeRO "
                        "(Megatron-DeepSpeed)")


def check(p: Parallel, inv: ParamInventory, strategy: Any, gpus: int, grad_accum: int) -> str:
    """The layout after checking the degrees against the model and the GPU count (SettingsError naming the
    numbers otherwise)."""
    for name in ("tp", "pp", "ep", "cp"):
        if getattr(p, name) < 1:
            raise SettingsError(f"--{name} must be at least 1, got {getattr(p, name)}")
    if p.vpp is not None and p.vpp < 1:
        raise SettingsError(f"--vpp must be at least 1, got {p.vpp}")
    if p.schedule not in SCHEDULES:
        raise SettingsError(f"unknown pipeline schedule {quote(p.schedule)}; valid: {', '.join(SCHEDULES)}")
    if gpus % (p.model_ranks * p.cp):
        if p.cp > 1:
            raise SettingsError(f"--gpus {gpus} is not a multiple of tp({p.tp}) x pp({p.pp}) x cp({p.cp}) = "
                                f"{p.model_ranks * p.cp}: the data-parallel size gpus / (tp x pp x cp) must be whole")
        raise SettingsError(f"--gpus {gpus} is not a multiple of tp({p.tp}) x pp({p.pp}) = {p.model_ranks}: the "
                            "data-parallel size gpus / (tp x pp) must be whole")
    layout = layout_of(strategy, p.pp)
    if p.cp > 1 and layout != TORCHTITAN:
        raise SettingsError(f"--cp with --strategy {strategy.name}: memplan models context parallelism as torchtitan "
                            "runs it (torch's ring attention, FSDP2, HSDP or DDP); DeepSpeed's Ulysses sequence "
                            "parallelism is another scheme")
    if p.pp > 1 and p.schedule not in LAYOUT_SCHEDULES[layout]:
        raise SettingsError(f"--schedule {p.schedule}: {layout} runs {', '.join(LAYOUT_SCHEDULES[layout])}")
    if p.schedule in pipeline.V_SHAPED and p.vpp not in (None, 2):
        raise SettingsError(f"--vpp {p.vpp} with --schedule {p.schedule}: {pipeline.TORCH_NAMES[p.schedule]} runs "
                            "exactly two stages per rank")
    if p.vpp not in (None, 1) and not p.multi_stage:
        raise SettingsError(f"--vpp {p.vpp} needs a schedule that runs several stages per rank (--schedule "
                            f"{' | '.join(s for s in SCHEDULES if s in pipeline.MULTI_STAGE)}); {p.schedule} runs one")
    if p.multi_stage and p.pp > 1 and p.virtual < 2:
        raise SettingsError(f"--schedule {p.schedule} needs at least 2 virtual stages per rank (--vpp)")
    d = inv.dims
    layers = len(inv.layer_blocks)
    if p.pp > 1:
        if not layers:
            raise SettingsError("--pp needs a model of repeated blocks; this one has none")
        stages = p.pp * (p.virtual if p.multi_stage else 1)
        effective = layers + (2 if layout == TORCHTITAN else 0)
        if stages > effective or (layout == MEGATRON_DEEPSPEED and p.pp > layers):
            raise SettingsError(f"--pp {p.pp}" + (f" x --vpp {p.virtual}" if stages != p.pp else "")
                                + f" = {stages} stages for {layers} blocks: more stages than "
                                + ("blocks" if layout == MEGATRON_DEEPSPEED else
                                   "blocks + 2 (torchtitan counts the embedding and the head as one block each)"))
    if p.tp > 1:
        heads, kv = d.get("num_heads"), d.get("num_kv_heads", d.get("num_heads"))
        inter = d.get("intermediate_size")
        if not heads:
            raise SettingsError("--tp needs the model's attention head count; this model does not declare it")
        if heads % p.tp:
            raise SettingsError(f"--tp {p.tp} does not divide the {heads} attention heads")
        if kv and kv % p.tp:
            if layout == TORCHTITAN or p.tp % kv:
                raise SettingsError(f"--tp {p.tp} does not divide the {kv} key/value heads" + (
                    " (Megatron replicates them only when tp is a multiple of their count)"
                    if layout != TORCHTITAN else " (DTensor's ColwiseParallel would split a head)"))
        if inter and inter % p.tp:
            raise SettingsError(f"--tp {p.tp} does not divide the MLP's {inter} intermediate features")
    if p.ep > 1:
        _check_ep(p, inv, strategy, gpus // p.model_ranks, layout)
    if p.pp > 1 and layout == TORCHTITAN:  # what torch's schedule constructors refuse
        pipeline.check(p.schedule, p.pp, grad_accum, p.virtual if p.multi_stage else 1)
    return layout


def routed_experts(inv: ParamInventory) -> int:
    """The routed experts of each MoE layer (0 for a dense model): dim 0 of the fused expert weights."""
    return max((t.shape[0] for t in inv.tensors if t.category == "experts" and len(t.shape) == 3), default=0)


def _check_ep(p: Parallel, inv: ParamInventory, strategy: Any, dp: int, layout: str) -> None:
    """Expert parallelism as torchtitan and transformers' native FSDP2 + EP lay it out (see Parallel.ep)."""
    experts = routed_experts(inv)
    if not experts:
        raise SettingsError(f"--ep {p.ep}: the model has no routed experts (fused [experts, out, in] weights); expert "
                            "parallelism splits MoE layers")
    if experts % p.ep:
        raise SettingsError(f"--ep {p.ep} does not divide the {experts} routed experts of each MoE layer")
    if layout != TORCHTITAN or strategy.name != "fsdp-full":
        raise SettingsError(f"--ep with --strategy {strategy.name}: memplan models expert parallelism under FSDP2 "
                            "fsdp-full, as torchtitan and transformers' DistributedConfig(ep_size) run it; "
                            "DeepSpeed's needs its own MoE layer (deepspeed.moe), which transformers' models do not "
                            "use")
    if p.pp > 1:
        raise SettingsError(f"--ep {p.ep} with --pp {p.pp}: expert parallelism is modelled without pipeline "
                            "parallelism for now")
    if p.ep % p.tp:
        raise SettingsError(f"--ep {p.ep} with --tp {p.tp}: ep must be a multiple of tp (transformers' "
                            "DistributedConfig: each EP group holds whole TP groups, which share their batch)")
    if (dp * p.tp) % p.ep:
        raise SettingsError(f"--ep {p.ep} does not divide the data-parallel ranks dp x tp = {dp * p.tp} it borrows "
                            "from (each expert's FSDP group is dp x tp / ep ranks)")
    efsdp = dp * p.tp // p.ep
    if efsdp > experts // p.ep:
        # more expert-FSDP ranks than local experts: torchtitan shards each expert on dim 1 (layouts.shard_dim),
        # which FSDP2 shards only evenly (_fsdp_param.py: "FSDP does not support uneven sharding on dim 1")
        for t in inv.tensors:
            if t.category == "experts" and len(t.shape) == 3 and t.shape[1] % efsdp:
                raise SettingsError(f"--ep {p.ep} over {dp * p.tp} data-parallel ranks: each expert is sharded on "
                                    f"dim 1 over efsdp = {efsdp} ranks (more than the {experts // p.ep} local "
                                    f"experts), and FSDP2 shards dim 1 only evenly: {t.name} has {t.shape[1]} rows")


# ---- pipeline stages ----

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
        return [[stages[i] for i in ids] for ids in pipeline.rank_stages(p.schedule, p.pp, v)]
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
    (memplan/pipeline.py, torch's schedules; Megatron's forward_backward_pipelining_without_interleaving and
    DeepSpeed's TrainSchedule, num_pipe_buffers min(stages - stage_id, micro_batches), hold what torch's 1F1B
    does)."""
    if p.pp == 1:
        return 1
    if layout == MEGATRON_DEEPSPEED:
        return min(micro_batches, p.pp - rank)
    return max(sum(held) for held, _, _ in held_moments(p, rank, micro_batches))


def held_moments(p: Parallel, rank: int, micro_batches: int) -> list[tuple[tuple[int, ...], int, str]]:
    """Each backward of a rank of the torchtitan layout (memplan/pipeline.py held_moments)."""
    return pipeline.held_moments(p.schedule, p.pp, micro_batches, p.virtual, rank)


# ---- tensor parallelism ----

def padded_vocab(vocab: int, p: Parallel, layout: str) -> int:
    """The vocabulary rows a TP rank's embedding and head hold at the most."""
    if layout == MEGATRON_DEEPSPEED:
        multiple = MEGATRON_VOCAB_MULTIPLE * p.tp
        return ceil_div(vocab, multiple) * multiple // p.tp
    return ceil_div(vocab, p.tp)  # torch.chunk: the first ranks hold ceil(V / tp)


def _tp_shape(t: ParamTensor, p: Parallel, layout: str, dims: dict[str, Any]) -> tuple[int, ...]:
    """The tensor's shape on the TP rank that holds the most of it."""
    tp, shape = p.tp, t.shape
    if tp == 1 or not shape:
        return shape
    parts = t.name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    vocab = dims.get("vocab_size")
    if t.category in ("embedding", "head") and vocab and shape[0] == vocab:
        return (padded_vocab(vocab, p, layout),) + shape[1:]
    if t.category == "experts" and len(shape) == 3:  # fused experts [E, out, in]: the projection's own rule
        if module == "experts" and parts[-1] in ("gate_up_proj", "w13"):
            return (shape[0], ceil_div(shape[1], tp), shape[2])
        if module == "experts" and parts[-1] in ("down_proj", "w2"):
            return (shape[0], shape[1], ceil_div(shape[2], tp))
        return shape
    conv1d = t.layer == "conv1d"  # transformers' Conv1D: weight [in, out]
    is_weight = parts[-1] == "weight"
    if module in COLUMN:
        out_dim = 1 if conv1d and is_weight else 0
        n = shape[out_dim]
        if module in KV and layout == MEGATRON_DEEPSPEED:
            kv = dims.get("num_kv_heads") or dims.get("num_heads")
            if kv and kv < tp:  # Megatron replicates the key/value heads: one per rank
                return tuple(n // kv if i == out_dim else s for i, s in enumerate(shape))
        return tuple(ceil_div(n, tp) if i == out_dim else s for i, s in enumerate(shape))
    if module in ROW and is_weight:
        in_dim = 0 if conv1d else 1
        if len(shape) > in_dim:
            return tuple(ceil_div(s, tp) if i == in_dim else s for i, s in enumerate(shape))
    return shape


def tp_inventory(inv: ParamInventory, p: Parallel, layout: str) -> ParamInventory:
    """The model as one TP rank holds it (the rank holding the most: the first, under uneven vocabulary splits),
    with its EP rank's experts: E / ep whole experts of each fused expert weight (transformers' MoEParamShard,
    Shard(0) over the EP mesh; torchtitan's ExpertParallel), FSDP-sharded over the dp / ep ranks that hold the
    same experts (ParamTensor.shard_split)."""
    if p.tp == 1 and p.ep == 1:
        return inv
    if p.ep > 1:
        # the routed experts: whole experts per EP rank, not TP-split (the EP plan takes precedence over the TP
        # plan for the same modules), FSDP-sharded over efsdp = dp x tp / ep, i.e. the rank's dp / (ep / tp)
        tensors = tuple(replace(t, shape=(t.shape[0] // p.ep,) + t.shape[1:], shard_split=p.ep // p.tp)
                        if t.category == "experts" and len(t.shape) == 3 else
                        replace(t, shape=_tp_shape(t, p, layout, inv.dims)) for t in inv.tensors)
    else:
        tensors = tuple(replace(t, shape=_tp_shape(t, p, layout, inv.dims)) for t in inv.tensors)
    return replace(inv, tensors=tensors, dims=rank_dims(inv.dims, p, layout))


def rank_dims(dims: dict[str, Any], p: Parallel, layout: str) -> dict[str, Any]:
    """The dimensions one TP rank computes with: its heads, key/value heads, MLP features and vocabulary rows."""
    out = dict(dims)
    tp = p.tp
    if tp == 1:
        return out
    heads = dims.get("num_heads")
    if heads:
        h = dims.get("hidden_size", 0)
        head_dim = dims.get("head_dim") or (h // heads if h else 0)
        out["num_heads"] = heads // tp
        out["head_dim"] = head_dim
        kv = dims.get("num_kv_heads")
        if kv:
            out["num_kv_heads"] = max(kv // tp, 1)
    if dims.get("intermediate_size"):
        out["intermediate_size"] = dims["intermediate_size"] // tp
    if dims.get("vocab_size"):
        out["vocab_size"] = padded_vocab(dims["vocab_size"], p, layout)
    out["tp"] = tp
    return out


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
    return replace(inv, tensors=tuple(tensors), dims=dims)


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


_SHARES: dict[tuple, tuple[ParamInventory, tuple[RankShare, ...]]] = {}


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
    def shape(sh: RankShare) -> tuple:
        return (tuple((tuple(sorted(b.numel for b in sh.inventory.layer_blocks)), c.first, c.last)
                      for c in sh.chunks[:1]) if len(sh.chunks) == 1 else id(sh),
                sh.first, sh.last, tuple(sorted((t.shape, t.trainable) for t in sh.inventory.tensors
                                                if t.block == ROOT_BLOCK)))
    best: dict[tuple, int] = {}
    for sh in shares:
        k = shape(sh)
        if k not in best or sh.in_flight > shares[best[k]].in_flight:
            best[k] = sh.rank
    keep = set(best.values())
    return {sh.rank for sh in shares if sh.rank not in keep}


def sp_saving(dims: dict[str, Any], p: Parallel, layout: str, residual_bytes: int, compute_bytes: int) -> int:
    """Bytes per token and block that sequence parallelism takes off a TP rank's activations: what is kept for
    backward outside the TP regions, at full hidden size without it.

    torchtitan (DTensor's SequenceParallel on the norms, PrepareModuleInput gathering the sequence before the
    projections, which then save the gathered input): each RMSNorm's own saved tensors, split (transformers'
    RMSNorm keeps the fp32 input, 4 bytes per feature, the normalised input in the residual dtype for the weight's
    multiply, and one fp32 rsqrt per token); measured on CPU, tp 2: 985 KB of 983 KB predicted this way for
    two blocks and the final norm. Megatron's (its linears save the sequence-sharded input and gather it again in
    backward: tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication): the two norms' inputs
    and the two projections' inputs (Korthikanti et al. 2022, the 10sbh term split)."""
    if not p.sp or p.tp == 1:
        return 0
    h = dims.get("hidden_size", 0)
    if layout == MEGATRON_DEEPSPEED:
        per = 2 * h * residual_bytes + 2 * h * compute_bytes
    else:
        per = 2 * norm_saved(h, residual_bytes)
    return per - per // p.tp


def norm_saved(h: int, residual_bytes: int) -> int:
    """Bytes per token one transformers RMSNorm keeps for backward (hidden_states.to(float32); the normalised
    input cast back to the residual dtype for ``weight * hidden``; rsqrt of the variance)."""
    return 4 * h + residual_bytes * h + 4


#: a non-last pipeline stage's trace: the model with this many vocabulary rows, so its loss is negligible (the
#: stage sends its output on; what it keeps is its blocks' activations and its input, the embedding's output size)
BARE_VOCAB = 16


def rank_config(config: dict[str, Any], p: Parallel, layout: str, with_loss: bool) -> dict[str, Any] | None:
    """The config of the model one TP rank computes (its heads, key/value heads, MLP features and vocabulary
    rows; head_dim kept), traced for its activations; ``with_loss`` False: a stage without the head. None where
    the config does not name those sizes the way transformers' decoder models do."""
    if config.get("factory"):
        return None
    if p.tp == 1 and p.pp == 1:  # context or expert parallelism alone: the whole model, run as one such rank
        c = dict(config)
        if p.ep > 1:
            c[EP_KEY] = p.ep
        if p.cp > 1:
            c[CP_KEY] = p.cp
        return c
    need = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    if any(not isinstance(config.get(k), int) for k in need):
        return None
    c = dict(config)
    heads = c["num_attention_heads"]
    c["head_dim"] = c.get("head_dim") or c["hidden_size"] // heads
    if p.tp > 1:
        c["num_attention_heads"] = heads // p.tp
        kv = c.get("num_key_value_heads")
        if isinstance(kv, int):
            c["num_key_value_heads"] = max(kv // p.tp, 1)
        # under EP the routed experts keep their size: moe_intermediate_size where the config has one, else (Mixtral)
        # intermediate_size is theirs
        experts_size = ("moe_intermediate_size" if "moe_intermediate_size" in c else "intermediate_size") \
            if p.ep > 1 else None
        for k in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if isinstance(c.get(k), int) and k != experts_size:
                c[k] = c[k] // p.tp
    # the loss runs on the rank's vocabulary rows, or on the whole gathered logits
    whole = layout == TORCHTITAN and not p.loss_parallel
    c["vocab_size"] = (config["vocab_size"] if whole else padded_vocab(config["vocab_size"], p, layout)) \
        if with_loss else BARE_VOCAB
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past the smaller vocabulary
        if isinstance(c.get(k), int) and c[k] >= c["vocab_size"]:
            c[k] = None
    if p.ep > 1:
        c[EP_KEY] = [p.ep, p.tp]
    if p.cp > 1:
        c[CP_KEY] = p.cp
    return c


def loss_parallel_extra(dims: dict[str, Any], p: Parallel, layout: str, seq_len: int) -> int:
    """Bytes per micro-batch of 1 that a TP rank's loss backward holds beyond the plain cross-entropy's, under
    torchtitan's loss parallelism (the head's logits left split by vocabulary, cross-entropy under
    torch.distributed.tensor.parallel.loss_parallel): its _nll_loss_and_log_softmax_backward computes
    ``(grad_input + torch.exp(x)) * grad_output`` over the rank's fp32 log-probabilities, one logits-sized fp32
    tensor more than aten's nll_loss_backward followed by _log_softmax_backward_data (measured on CPU: 2 ranks,
    +1,048,576 B at the loss's backward for 256 tokens x 1,024 local vocabulary rows)."""
    if p.tp == 1 or layout != TORCHTITAN or not p.loss_parallel:
        return 0
    return 4 * seq_len * padded_vocab(dims.get("vocab_size", 0), p, layout)


def stage_output(dims: dict[str, Any], p: Parallel, layout: str, last: bool, recipe: Any) -> int:
    """Bytes per token of a pipeline stage's output that its in-flight micro-batches keep beyond what their
    blocks save (torch.distributed.pipelining's PipelineStage.fwd_cache holds each micro-batch's output until
    its backward): the last stage's logits in the compute dtype (the loss works on their fp32 copy); another
    stage's last hidden state in the residual dtype, unless fp32 (then the final norm of a whole model would
    have saved that very tensor; a stage without that norm keeps it here), split over the TP ranks under sequence
    parallelism."""
    if p.pp == 1:
        return 0
    if last:
        return recipe.compute_bytes * padded_vocab(dims.get("vocab_size", 0), p, layout)
    # the last block's output: under sequence parallelism the rank's share of the sequence (sp_tokens)
    return dims.get("hidden_size", 0) * (recipe.residual_bytes if recipe.residual_bytes < 4 else 4) // _sp_split(p)


def recv_buffers(dims: dict[str, Any], p: Parallel, share: RankShare, micro_batches: int, tokens: int,
                 recipe: Any, layout: str = TORCHTITAN) -> int:
    """A pipeline rank's receive buffers, made once for every micro-batch of a step and kept
    (torch/distributed/pipelining/stage.py _setup_forward_recv_info: a buffer per micro-batch for the
    activations a stage after the first receives; _create_grad_recv_info / _setup_backward_recv_info: one per
    micro-batch for the gradients a stage before the last receives); ``tokens`` per micro-batch. Each holds the
    hidden state between stages, [micro-batch, seq, hidden] in the residual dtype (its sequence split over the TP
    ranks under sequence parallelism: sp_tokens); measured on CPU (2 stages, 4 micro-batches of 2 x 128 tokens,
    hidden 256, bf16): 524,288 B on each rank from the first step on."""
    if p.pp == 1:
        return 0
    each = sp_tokens(tokens, p) * dims.get("hidden_size", 0) * recipe.residual_bytes
    chunks = len(share.chunks)
    n = sum((0 if c.first else 1) + (0 if c.last else 1) for c in share.chunks) if chunks else 0
    if layout == MEGATRON_DEEPSPEED:
        # DeepSpeed's PipelineEngine keeps one of each (engine.py pipe_recv_buf, grad_layer) and clones each
        # received activation (_exec_recv_activations: pipe_recv_buf.clone()): the clones are in stage_input
        return n * each
    return n * micro_batches * each


def stage_input(dims: dict[str, Any], p: Parallel, layout: str, first: bool, recipe: Any) -> int:
    """Bytes per token of a received stage input each in-flight micro-batch keeps beyond the blocks' saved
    tensors: DeepSpeed's clone of its receive buffer (torch's pipelining receives into a buffer per micro-batch,
    counted in recv_buffers)."""
    if p.pp == 1 or first or layout != MEGATRON_DEEPSPEED:
        return 0
    return dims.get("hidden_size", 0) * recipe.residual_bytes // _sp_split(p)


def sp_tokens(tokens: int, p: Parallel) -> int:
    """The tokens of a hidden state passed between blocks, and so between pipeline stages, on one TP rank: all of
    them, or under sequence parallelism its share of the sequence. torchtitan's plan (llama3 parallelize.py apply_tp,
    as the harness applies it): the embedding RowwiseParallel(output_layouts=Shard(1)) and each block's wo and w2
    RowwiseParallel(output_layouts=Shard(1)) with use_local_output, so the residual stream is the local [batch,
    seq / tp, hidden] tensor that a stage returns and the next receives; Megatron's get_tensor_shapes
    (core/pipeline_parallel/schedules.py: seq_length // tp_size when sequence_parallel), its embedding scattered to
    the sequence-parallel region."""
    return -(-tokens // _sp_split(p))


def _sp_split(p: Parallel) -> int:
    return p.tp if p.sp and p.tp > 1 else 1


# ---- context parallelism ----

def ring_attention(dims: dict[str, Any], p: Parallel, seq_local: int, compute_bytes: int) -> tuple[int, int]:
    """Bytes per micro-batch of 1 that torch's ring attention holds during one attention beyond the local kernel's own
    (torch/distributed/tensor/experimental/_context_parallel/_attention.py, torch 2.13, its defaults: all-gather
    rotation, fp32 merge and accumulators), for seq_local = seq / cp tokens; (forward, backward). With K the bytes of
    a local key (or value), Q of the local query, and fp32 copies Kf, Qf:
    - forward (_templated_ring_attention): key and value made contiguous (2K), concatenated (2K) and all-gathered
      once (_AllGatherRotater: cp x 2K); each step's output (Q) and logsumexp merged in fp32 (_SDPAMerger: the out
      Qf and one temporary of it, and the logsumexps);
    - backward (_templated_ring_attention_backward): the fp32 accumulators of dq, dk, dv (Qf + 2Kf), key and value
      contiguous again (2K), concatenated and all-gathered (2K + cp x 2K), a step's dq, dk, dv (Q + 2K) and dk, dv
      cast to fp32 to accumulate (2Kf), the accumulated dk, dv concatenated (2Kf) and passed on (_AllToAllRotater's
      permute: 2Kf).
    An upper bound of each: measured with the CPU harness over gloo (docs/accuracy.md, Session 20)."""
    if p.cp <= 1:
        return 0, 0
    h = dims.get("hidden_size", 0)
    heads = dims.get("num_heads") or 0
    if not heads:
        return 0, 0
    hd = dims.get("head_dim") or h // heads
    kv = dims.get("num_kv_heads") or heads
    K = seq_local * kv * hd * compute_bytes
    Q = seq_local * heads * hd * compute_bytes
    Kf, Qf, lse = 4 * K // compute_bytes, 4 * Q // compute_bytes, 4 * seq_local * heads
    forward = 4 * K + 2 * p.cp * K + Q + 2 * Qf + 2 * lse
    backward = Qf + 2 * Kf + 2 * K + 2 * K + 2 * p.cp * K + Q + 2 * K + 2 * Kf + 2 * Kf + 2 * Kf
    return forward, backward


# ---- zero-bubble schedules ----

def zero_bubble_grads(dims: dict[str, Any], layers: int, tokens: int, compute_bytes: int) -> int:
    """Bytes per micro-batch (of ``tokens`` tokens) that a zero-bubble schedule's input-gradient step keeps for its
    weight-gradient step, beyond a backward's: torch's stage_backward_input (torch/distributed/pipelining/
    _backward.py) computes the input's gradient with the graph retained and stores, per parameter group, the
    gradients flowing into the weight-gradient subgraphs (param_group["grads"]): of each linear's output, the
    q, k, v, o, gate, up and down projections' outputs of every block of the stage, in the compute dtype."""
    h = dims.get("hidden_size", 0)
    heads = dims.get("num_heads") or 1
    hd = dims.get("head_dim") or h // heads
    kv = dims.get("num_kv_heads") or heads
    inter = dims.get("intermediate_size", 4 * h)
    gated = dims.get("gated_mlp", 1)
    per_token = heads * hd + 2 * kv * hd + h + (2 if gated else 1) * inter + h
    return layers * tokens * per_token * compute_bytes
