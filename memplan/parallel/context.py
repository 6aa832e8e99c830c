"""Context parallelism (CP): each rank holds 1/cp of every sequence and runs torch's ring attention over the group."""

from __future__ import annotations

from typing import Any

from memplan.parallel.degrees import Parallel


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
