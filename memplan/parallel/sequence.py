"""Sequence parallelism (SP, with TP): the norms' and residuals' activations split over the TP ranks."""

from __future__ import annotations

from typing import Any

from memplan.parallel.degrees import MEGATRON_DEEPSPEED, Parallel


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
    h: int = dims.get("hidden_size", 0)
    if layout == MEGATRON_DEEPSPEED:
        per = 2 * h * residual_bytes + 2 * h * compute_bytes
    else:
        per = 2 * norm_saved(h, residual_bytes)
    return per - per // p.tp


def norm_saved(h: int, residual_bytes: int) -> int:
    """Bytes per token one transformers RMSNorm keeps for backward (hidden_states.to(float32); the normalised
    input cast back to the residual dtype for ``weight * hidden``; rsqrt of the variance)."""
    return 4 * h + residual_bytes * h + 4


def sp_tokens(tokens: int, p: Parallel) -> int:
    """The tokens of a hidden state passed between blocks, and so between pipeline stages, on one TP rank: all of
    them, or under sequence parallelism its share of the sequence. torchtitan's plan (llama3 parallelize.py apply_tp,
    as the harness applies it): the embedding RowwiseParallel(output_layouts=Shard(1)) and each block's wo and w2
    RowwiseParallel(output_layouts=Shard(1)) with use_local_output, so the residual stream is the local [batch,
    seq / tp, hidden] tensor that a stage returns and the next receives; Megatron's get_tensor_shapes
    (core/pipeline_parallel/schedules.py: seq_length // tp_size when sequence_parallel), its embedding scattered to
    the sequence-parallel region."""
    return -(-tokens // sp_split(p))


def sp_split(p: Parallel) -> int:
    return p.tp if p.sp and p.tp > 1 else 1
