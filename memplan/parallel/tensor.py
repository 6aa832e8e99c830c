"""Tensor parallelism (TP): each rank's share of every tensor-parallel linear, embedding and head, and the config of
the model one TP rank computes (traced for its activations)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memplan.model.inventory import ParamInventory, ParamTensor
from memplan.units import ceil_div
from memplan.parallel.degrees import CP_KEY, EP_KEY, MEGATRON_DEEPSPEED, Parallel, TORCHTITAN


#: Megatron's make_vocab_size_divisible_by default
MEGATRON_VOCAB_MULTIPLE = 128


#: projections split by output features (ColumnParallelLinear / ColwiseParallel), by the module's name
COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "c_attn",
                    "c_fc", "fc1", "query_key_value", "dense_h_to_4h", "w1", "w3", "wq", "wk", "wv", "wqkv",
                    "query", "key", "value", "Wqkv"})


#: projections split by input features (RowParallelLinear / RowwiseParallel); their bias stays whole
ROW = frozenset({"o_proj", "down_proj", "c_proj", "dense", "dense_4h_to_h", "fc2", "w2", "wo", "out_proj"})


KV = frozenset({"k_proj", "v_proj", "wk", "wv", "key", "value"})


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
