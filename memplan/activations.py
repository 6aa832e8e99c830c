"""Activation bytes per rank: the analytic profile used until the traced profile (issue 4) replaces it.

The profile counts the tensors autograd saves for backward, per transformer block and per token, following
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Section 4.1 and
Table 2), generalised to grouped-query attention, gated (SwiGLU) MLPs and the attention kernel in use:

attention part, per token (elements):
  h      norm input (kept by RMSNorm/LayerNorm backward, residual dtype)
  h      normed input read by the q/k/v projections
  h+2kv  q, k, v after rotary embedding, read by the attention kernel
  h      attention output, read by the output projection
  flash / memory-efficient kernels also keep the logsumexp: heads fp32 values;
  eager / math attention keeps the softmax probabilities: heads * seq values (the quadratic term, 2as^2b of
  Korthikanti's 5as^2b with dropout off; the mask and pre-softmax scores are not kept without dropout)
MLP part, per token (elements):
  h      norm input, h normed input read by the up/gate projections
  gated (SwiGLU): gate, up, act(gate), act(gate)*up  -> 4 * intermediate
  plain (GELU): fc output, gelu output                -> 2 * intermediate
Loss (per token, on the rank holding the head): logits in the compute dtype, their fp32 upcast and the fp32
log-softmax kept by cross-entropy: vocab * (compute + 4 + 4) bytes; in backward the fp32 gradient of the logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from memplan.errors import SettingsError

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("flash", "sdpa", "eager")


@dataclass(frozen=True)
class ActivationProfile:
    """Bytes for one rank's micro-batch."""

    per_layer_bytes: int  #: saved for backward by one block, no recompute
    layer_input_bytes: int  #: a block's input (what full recompute keeps per block)
    num_layers: int
    loss_forward_bytes: int  #: logits + fp32 upcast + log-softmax, alive from the head to the loss backward
    loss_backward_bytes: int  #: gradient of the logits (fp32) and its compute-dtype cast, in the head backward
    embedding_bytes: int  #: embedding output kept for the first block
    source: str  #: "analytic (Korthikanti et al. 2022, generalised)" or the traced profile's description

    def saved_bytes(self, recompute: str) -> int:
        """Activations alive at the end of forward."""
        if recompute == "full":
            return self.num_layers * self.layer_input_bytes + self.embedding_bytes
        return self.num_layers * self.per_layer_bytes + self.embedding_bytes

    def recompute_transient_bytes(self, recompute: str) -> int:
        """Extra bytes while one block is recomputed in backward (full recompute only)."""
        return self.per_layer_bytes if recompute == "full" else 0


def analytic_profile(dims: dict, *, micro_batch: int, seq_len: int, compute_bytes: int, residual_bytes: int,
                     attention: str, recompute: str, gated_mlp: bool) -> ActivationProfile:
    if attention not in ATTENTION:
        raise SettingsError(f"unknown attention {attention!r}; valid: {', '.join(ATTENTION)}")
    if recompute not in RECOMPUTE:
        raise SettingsError(f"unknown recompute {recompute!r}; valid: {', '.join(RECOMPUTE)}")
    h = dims.get("hidden_size")
    layers = dims.get("num_layers")
    heads = dims.get("num_heads")
    vocab = dims.get("vocab_size", 0)
    if not h or not layers or not heads:
        raise SettingsError("the model's hidden size, layer count and head count are needed for activations; "
                            "this model does not declare them")
    inter = dims.get("intermediate_size") or 4 * h
    kv_dim = h * dims.get("num_kv_heads", heads) // heads
    tokens = micro_batch * seq_len
    attn_elems = h + (h + 2 * kv_dim) + h  # normed input, q/k/v, output
    attn_bytes = tokens * (attn_elems * compute_bytes + h * residual_bytes)
    # "sdpa" on a GPU dispatches to flash / memory-efficient kernels for causal training (no quadratic term);
    # only eager (or math) attention keeps the probabilities.
    if attention == "eager" and recompute == "none":
        attn_bytes += micro_batch * heads * seq_len * seq_len * compute_bytes
    else:
        attn_bytes += micro_batch * heads * seq_len * 4  # logsumexp, fp32
    mlp_elems = h + (4 if gated_mlp else 2) * inter
    mlp_bytes = tokens * (mlp_elems * compute_bytes + h * residual_bytes)
    return ActivationProfile(
        per_layer_bytes=attn_bytes + mlp_bytes,
        layer_input_bytes=tokens * h * residual_bytes,
        num_layers=layers,
        loss_forward_bytes=tokens * vocab * (compute_bytes + 4 + 4),
        loss_backward_bytes=tokens * vocab * (4 + compute_bytes),
        embedding_bytes=tokens * h * residual_bytes,
        source="analytic (Korthikanti et al. 2022, generalised to GQA / gated MLP)",
    )


@lru_cache(maxsize=4096)
def cached_profile(dims: tuple, micro_batch: int, seq_len: int, compute_bytes: int, residual_bytes: int,
                   attention: str, recompute: str, gated_mlp: bool) -> ActivationProfile:
    """analytic_profile memoised on hashable arguments (the planner evaluates many configurations)."""
    return analytic_profile(dict(dims), micro_batch=micro_batch, seq_len=seq_len, compute_bytes=compute_bytes,
                            residual_bytes=residual_bytes, attention=attention, recompute=recompute,
                            gated_mlp=gated_mlp)
