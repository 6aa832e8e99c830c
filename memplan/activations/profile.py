"""Activation bytes per rank for one micro-batch: the traced profile (default) or the analytic cross-check.

Traced (``memplan.activations.tracing``): transformers' real modeling code run under FakeTensorMode at the real size, the
live bytes of the step followed op by op, the attention kernel substituted; cached on disk and shipped with the
package (``memplan.activations.profile_cache``) for the presets' default settings, so an estimate on a preset does not import torch.

Analytic (``--activations analytic``, and the fallback when a model cannot be traced): the profile counts the tensors autograd saves for backward, per transformer block and per token, following
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

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, NamedTuple

from memplan.errors import SettingsError
from memplan.inputs import quote

RECOMPUTE = ("none", "selective", "op-sac", "full")
#: timeline.Moment.INSIDE_LAST_BLOCK_FORWARD (its value: the profile's key for that moment)
INSIDE_LAST_BLOCK_FORWARD = -8
#: "op-sac": torchtitan's per-op selective activation checkpointing (activation_checkpoint.mode "selective",
#: selective_ac_option "op"; torchtitan 54aeddf5 distributed/activation_checkpoint.py _apply_op_sac with the llama3
#: _op_sac_save_list of models/llama3/infra/parallelize.py): every block checkpointed, but the outputs of its
#: matmuls (all but every second aten.mm) and of the fused attention kernels kept (memplan/model/meta_builder.py
#: op_sac_context_fn)
OP_SAC = "op-sac"
ATTENTION = ("flash", "sdpa", "eager")
ACTIVATION_SOURCES = ("traced", "analytic")
#: and "every:N": transformers' activation_checkpointing_enable(every_n_layers=N) (modeling_utils.py
#: _set_gradient_checkpointing, transformers 5.23): the decoder layers counted in module order, layer i
#: checkpointed when i % N == 0 (layers 0, N, 2N, ...), the rest keep their activations
EVERY = "every:"
#: and "layer-sac:N": torchtitan's layer-wise selective activation checkpointing (activation_checkpoint.mode
#: "selective", selective_ac_option "N"; torchtitan/distributed/activation_checkpoint.py _apply_layer_sac: a
#: counter incremented before the test, a block wrapped when count % N == 0): blocks N-1, 2N-1, ...
LAYER_SAC = "layer-sac:"


def valid_recompute(recompute: str) -> str:
    """``recompute`` checked and normalised (every:1 and layer-sac:1 are full); SettingsError naming the valid
    values."""
    if recompute in RECOMPUTE:
        return recompute
    for prefix in (EVERY, LAYER_SAC):
        if isinstance(recompute, str) and recompute.startswith(prefix):
            n = recompute[len(prefix):]
            if not n.isdigit() or int(n) < 1:
                raise SettingsError(f"--recompute {prefix}N takes a whole number of layers N >= 1, "
                                    f"got {quote(recompute)}")
            return "full" if int(n) == 1 else f"{prefix}{int(n)}"
    raise SettingsError(f"unknown recompute {quote(recompute)}; valid: {', '.join(RECOMPUTE)}, every:N, layer-sac:N")


def checkpoint_every(recompute: str) -> int | None:
    """N when every N-th block is checkpointed (1: full recompute, op-sac), None without checkpointing."""
    if recompute in ("full", OP_SAC):
        return 1
    for prefix in (EVERY, LAYER_SAC):
        if recompute.startswith(prefix):
            return int(recompute[len(prefix):])
    return None


def checkpoint_offset(recompute: str) -> int:
    """The first checkpointed block: 0 (transformers' every_n_layers, full), N - 1 (torchtitan's layer SAC)."""
    return int(recompute[len(LAYER_SAC):]) - 1 if recompute.startswith(LAYER_SAC) else 0


def is_checkpointed(recompute: str, block: int) -> bool:
    """Whether block ``block`` (0-based, module order) is checkpointed."""
    every = checkpoint_every(recompute)
    return every is not None and block % every == checkpoint_offset(recompute)


def checkpointed_blocks(recompute: str, layers: int) -> int:
    """How many of ``layers`` blocks are checkpointed."""
    every = checkpoint_every(recompute)
    if every is None:
        return 0
    off = checkpoint_offset(recompute)
    return 0 if layers <= off else (layers - 1 - off) // every + 1


def last_checkpointed(recompute: str, layers: int) -> bool:
    """Whether the last block (index layers - 1) is checkpointed."""
    return is_checkpointed(recompute, layers - 1)


class Terms(NamedTuple):
    """A profile's activation bytes at a micro-batch, the figures the engine reads at its moments."""

    forward: int  #: the forward's peak (the loss included)
    backward_start: int  #: the peak as backward begins
    saved_less_block: int  #: alive when the last block's gradients are complete: all saved but that block's own
    left_at_end: int  #: left at backward's end
    block: int  #: one block's saved bytes: what each further block's backward frees


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

    def forward_bytes(self, recompute: str) -> int:
        """Activations at the forward peak (end of forward, with the loss's transients)."""
        return self.saved_bytes(recompute) + self.loss_forward_bytes

    def backward_bytes(self, recompute: str) -> int:
        """Activations at the backward peak (loss backward, or the block being recomputed)."""
        return (self.saved_bytes(recompute) + self.loss_forward_bytes + self.loss_backward_bytes
                + self.recompute_transient_bytes(recompute))

    #: autocast's bf16 weight copies are not in this profile (the engine adds them)
    includes_autocast_copies = False

    def saved_bytes(self, recompute: str) -> int:
        """Activations alive at the end of forward (op-sac: what no recompute keeps, an upper bound: this
        profile does not know which operations its policy keeps)."""
        if recompute == OP_SAC:
            return self.num_layers * self.per_layer_bytes + self.embedding_bytes
        k = checkpointed_blocks(recompute, self.num_layers)
        return (k * self.layer_input_bytes + (self.num_layers - k) * self.per_layer_bytes
                + self.embedding_bytes)

    def block_moments(self, micro_batch: int, grad_width: int, held: bool = False) -> tuple[tuple[int, int], ...]:
        """Inside a block's backward (see TracedProfile.block_moments): the analytic profile has no timeline."""
        return ()

    def moment_activations(self, micro_batch: int) -> dict[int, int]:
        """Activations at named moments (see TracedProfile.moment_activations): none without a timeline."""
        return {}

    def loss_moment(self, micro_batch: int, grad_width: int) -> tuple[int, int] | None:
        """The head's backward with its gradients (see TracedProfile.loss_moment): none without a timeline."""
        return None

    def block_hooks(self, micro_batch: int) -> tuple:
        """Activations at each block parameter's hook (see TracedProfile.block_hooks): none without a timeline."""
        return ()

    def root_first_hook(self, micro_batch: int) -> tuple[int, int] | None:
        """The backward's first gradient hook (see TracedProfile.root_first_hook): none without a timeline."""
        return None

    def recompute_transient_bytes(self, recompute: str) -> int:
        """Extra bytes while one block is recomputed in backward (a checkpointed block's)."""
        return self.per_layer_bytes if checkpoint_every(recompute) else 0

    def terms(self, recompute: str, micro_batch: int) -> Terms:
        """(forward peak, backward-start peak, alive when the last block's grads are complete, left at backward
        end, one block's saved bytes) at ``micro_batch``. The third is everything saved but that block's own
        activations (freed by its backward; with full recompute, its checkpointed input); the last is what each
        further block's backward frees.

        Every term is a count of tokens times bytes per token, so it scales exactly with the micro-batch; this
        profile must have been built for a micro-batch of 1 (accounting builds it so).
        """
        block = self.layer_input_bytes if last_checkpointed(recompute, self.num_layers) and recompute != OP_SAC \
            else self.per_layer_bytes
        return Terms(micro_batch * self.forward_bytes(recompute), micro_batch * self.backward_bytes(recompute),
                     micro_batch * (self.saved_bytes(recompute) - block), micro_batch * self.embedding_bytes,
                     micro_batch * block)


def analytic_profile(dims: dict, *, micro_batch: int, seq_len: int, compute_bytes: int, residual_bytes: int,
                     attention: str, recompute: str, gated_mlp: bool) -> ActivationProfile:
    if attention not in ATTENTION:
        raise SettingsError(f"unknown attention {quote(attention)}; valid: {', '.join(ATTENTION)}")
    recompute = valid_recompute(recompute)
    h = dims.get("hidden_size")
    layers = dims.get("num_layers")
    heads = dims.get("num_heads")
    vocab = dims.get("vocab_size", 0)
    if not h or not layers or not heads:
        raise SettingsError("the model's hidden size, layer count and head count are needed for activations; "
                            "this model does not declare them")
    inter = dims.get("intermediate_size") or 4 * h
    kv_dim = h * dims.get("num_kv_heads", heads) // heads
    q_dim = h
    if dims.get("head_dim"):  # a tensor-parallel rank's heads (memplan/parallel/tensor.py rank_dims)
        q_dim, kv_dim = heads * dims["head_dim"], dims.get("num_kv_heads", heads) * dims["head_dim"]
    tokens = micro_batch * seq_len
    attn_elems = h + (q_dim + 2 * kv_dim) + q_dim  # normed input, q/k/v, output
    attn_bytes = tokens * (attn_elems * compute_bytes + h * residual_bytes)
    # "sdpa" on a GPU dispatches to flash / memory-efficient kernels for causal training (no quadratic term);
    # only eager (or math) attention keeps the probabilities.
    if attention == "eager" and (recompute in ("none", OP_SAC) or recompute.startswith((EVERY, LAYER_SAC))):
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


@dataclass(frozen=True)
class TracedProfile:
    """A traced profile (see memplan.activations.tracing.trace_profile) evaluated at one micro-batch."""

    data: dict  #: the traced profile: lines c0 + c1*b
    micro_batch: int
    #: "shipped", "cache", "traced now", or for a profile fitted at another length the traces it was fitted from
    #: (profile_cache._fitted: "shipped traces at seq 1024, 2048, 4096")
    origin: str
    #: evaluations by (what, micro-batch, ...): the planner asks the same micro-batches for many configurations
    _memo: dict = field(default_factory=dict, compare=False, repr=False)
    #: the job's weights are leaf parameters, so autocast caches their casts for its region as the trace did;
    #: False where the framework computes with views of a flat buffer (FSDP1, use_orig_params=False:
    #: _use_unsharded_views), which cached_cast never caches (a view, not a leaf)
    cached_casts: bool = True

    includes_autocast_copies = True  #: autocast's weight copies are traced (saved for backward)

    def _at(self, line: list[int]) -> int:
        return line[0] + line[1] * self.micro_batch

    def _extra_at(self, micro_batch: int) -> int:
        """The untraced blocks' saved activations at ``micro_batch``."""
        d, line = self.data, self.data["per_layer"]
        return (d["num_layers"] - d["traced_layers"]) * (line[0] + line[1] * micro_batch)

    def _extra_layers(self) -> int:
        return self._extra_at(self.micro_batch)

    def _forward_extra_at(self, micro_batch: int) -> int:
        """The untraced blocks' bytes alive in the forward after them (their saved activations, and what lives
        only until the forward ends: autocast's cached weight casts, which a checkpointed block does not save),
        read off the traced allocation events as the replay repeats them (replay.forward_block_line); the saved
        line where the profile has no events."""
        d = self.data
        if not self.cached_casts:
            return self._extra_at(micro_batch)
        if "forward_line" not in self._memo:
            from memplan.replay import forward_block_line

            ev = d.get("alloc_events")
            self._memo["forward_line"] = (ev and forward_block_line(ev)) or d["per_layer"]
        line = self._memo["forward_line"]
        return (d["num_layers"] - d["traced_layers"]) * (line[0] + line[1] * micro_batch)

    def forward_bytes(self, recompute: str) -> int:
        return max(self._at(x) for x in self.data["forward_peak"]) + self._forward_extra_at(self.micro_batch)

    def backward_bytes(self, recompute: str) -> int:
        return max(self._at(x) for x in self.data["backward_peak"]) + self._extra_layers()

    def saved_bytes(self, recompute: str) -> int:
        return self._at(self.data["live_after_forward"]) + self._extra_layers()

    @property
    def embedding_bytes(self) -> int:
        return 0

    def terms(self, recompute: str, micro_batch: int) -> Terms:
        """(forward peak, backward-start peak, alive when the last block's grads are complete, left at backward
        end, one block's saved bytes) at ``micro_batch``: every timeline point is a line c0 + c1 * b, so each
        term is exact at any micro-batch. The third is the activations alive after forward less one block's
        (traced as the difference between depths 2 and 1)."""
        key = ("terms", micro_batch)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._terms(micro_batch)
        return hit

    def _terms(self, micro_batch: int) -> Terms:
        d, b = self.data, micro_batch
        extra_line = d["per_layer"]
        block = extra_line[0] + extra_line[1] * b
        extra = (d["num_layers"] - d["traced_layers"]) * block
        return Terms(max(x[0] + x[1] * b for x in d["forward_peak"]) + self._forward_extra_at(b),
                     max(x[0] + x[1] * b for x in d["backward_peak"]) + extra,
                     d["live_after_forward"][0] + d["live_after_forward"][1] * b + extra - block, 0, block)

    def block_moments(self, micro_batch: int, grad_width: int, held: bool = False) -> tuple[tuple[int, int], ...]:
        """Inside the backward of the last block, of the one before it, of the first and of the second: (activation
        bytes, the block's parameter-gradient elements created so far) at the moment where activations plus those
        gradients at ``grad_width`` bytes each peak; ``held``: only the gradients whose post-accumulate hook has
        not run yet (a strategy that takes each gradient in that hook). The last two traced blocks stand for the
        model's last two, with the untraced blocks' saved activations below them; the first has no block below
        it. Empty for profiles traced before these were recorded."""
        key = ("blocks", micro_batch, grad_width, held)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._block_moments(micro_batch, f"held{grad_width}" if held else
                                                        str(grad_width))
        return hit

    def _block_moments(self, micro_batch: int, width_key: str) -> tuple[tuple[int, int], ...]:
        d, b = self.data, micro_batch
        segs = d.get("block_backward") or ()
        first = d.get("first_block_backward")
        if not segs or not first:
            return ()
        extra = self._extra_at(b)
        out = []
        grad_width = int(width_key.removeprefix("held"))
        # the second block (index 1): traced at full depth, its own backward; two alike traced blocks, the first
        # one's with one block saved below it; else (traced at full depth before it was recorded) not evaluated
        per = d.get("per_layer") or (0, 0)
        rows = [(segs[0], extra), (segs[-1], extra), (first, 0)]
        if d.get("second_block_backward"):
            rows.append((d["second_block_backward"], 0))
            if d.get("any_block_backward"):  # traced at full depth: the whole backward, its gradients (the fifth)
                rows.append((d["any_block_backward"], 0))
        elif d.get("traced_layers", 0) < d.get("num_layers", 0):
            rows.append((segs[-1], per[0] + per[1] * b))
        for seg, below in rows:
            env = seg.get(width_key)
            if not env:
                return ()
            c0, c1, g = max(env, key=lambda x: x[0] + x[1] * b + grad_width * x[2])
            out.append((c0 + c1 * b + below, g))
        return tuple(out)

    def block_hooks(self, micro_batch: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per block (the last, the one before it, the first): (activation bytes, gradient elements) at each of
        its parameters' post-accumulate hooks, the untraced blocks' saved activations below the first two."""
        key = ("hooks", micro_batch)
        if key not in self._memo:
            d, b = self.data, micro_batch
            segs = d.get("block_backward") or ()
            first = d.get("first_block_backward")
            out: tuple = ()
            if segs and first and all("hooks" in x for x in (segs[0], segs[-1], first)):
                extra = self._extra_at(b)
                out = tuple(tuple((c0 + c1 * b + below, g) for c0, c1, g in seg["hooks"])
                            for seg, below in ((segs[0], extra), (segs[-1], extra), (first, 0)))
            self._memo[key] = out
        return self._memo[key]

    def loss_moment(self, micro_batch: int, grad_width: int) -> tuple[int, int] | None:
        """In the loss's and the head's backward: (activation bytes, gradient elements of the parameters outside
        the blocks created so far) where activations plus those gradients at ``grad_width`` bytes each peak
        (the head's weight-gradient GEMM, or the loss's own peak); every block's saved activations below."""
        key = ("loss", micro_batch, grad_width)
        if key not in self._memo:
            d, b = self.data, micro_batch
            env = (d.get("loss_backward") or {}).get(str(grad_width))
            if not env:
                self._memo[key] = None
            else:
                extra = self._extra_at(b)
                c0, c1, g = max(env, key=lambda x: x[0] + x[1] * b + grad_width * x[2])
                self._memo[key] = (c0 + c1 * b + extra, g)
        return self._memo[key]

    def root_first_hook(self, micro_batch: int) -> tuple[int, int] | None:
        """(activation bytes, gradient elements of the parameters outside the blocks made so far) at the
        backward's first gradient hook (the head's weight's, or the final norm's where the head is tied: where
        DeepSpeed ZeRO-1/2 set their bucket up), every block's saved activations below; None where the profile
        has not recorded it (traced before profile version 19)."""
        line = self.data.get("root_first_hook")
        if line is None:
            return None
        return line[0] + line[1] * micro_batch + self._extra_at(micro_batch), line[2]

    def moment_activations(self, micro_batch: int) -> dict[int, int]:
        """Activations when the last block's backward begins (-5), when the one before it begins (-6), when
        the last block's forward begins (-7) and at the most inside it (-8), when the one before the last
        has finished its backward (-9), at the last hook of a parameter outside the blocks before them (-12),
        read off the traced timeline, untraced blocks below added; when the first block's backward begins
        (-13), the other blocks' activations freed."""
        key = ("named", micro_batch)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._moment_activations(micro_batch)
        return hit

    def _moment_activations(self, micro_batch: int) -> dict[int, int]:
        d, b = self.data, micro_batch
        segs = d.get("block_backward") or ()
        fwd = d.get("last_block_forward_start")
        if not segs or fwd is None or "start" not in segs[0]:
            return {}
        extra, fextra = self._extra_at(b), self._forward_extra_at(b)
        at = lambda line: line[0] + line[1] * b + extra  # noqa: E731
        fat = lambda line: line[0] + line[1] * b + fextra  # noqa: E731  (in the forward: see _forward_extra_at)
        peak = d.get("last_block_forward_peak") or [[0, 0]]
        out = {-5: at(segs[0]["start"]), -6: at(segs[-1]["start"]), -7: fat(fwd), -8: max(fat(x) for x in peak)}
        if len(segs) > 1 and "end" in segs[1]:
            out[-9] = at(segs[1]["end"])
        if d.get("root_hooks_done") is not None:
            out[-12] = at(d["root_hooks_done"])
        first = d.get("first_block_backward")
        if first and "start" in first:  # the other blocks' activations freed: no untraced blocks below
            out[-13] = first["start"][0] + first["start"][1] * b
        return out

    @property
    def source(self) -> str:
        d = self.data
        kind = "fitted from" if d.get("fitted_from") else "traced"
        return (f"{kind} ({self.origin}; transformers {d['transformers']}, {d['traced_layers']} of "
                f"{d['num_layers']} blocks traced, attention "
                f"{'sdpa (the device kernel)' if d['attention'] == 'flash' else d['attention']}, seq {d['seq_len']}"
                + (f", torch.compile {d['compile']} (inductor's partitioner)" if d.get("compile") else "") + ")")


def has_dropout(config: dict) -> bool:
    """Whether the config trains with any dropout (its names differ by family: attn_pdrop, hidden_dropout, ...)."""
    return any(("dropout" in k or "pdrop" in k) and isinstance(v, (int, float)) and not isinstance(v, bool)
               and v > 0 for k, v in config.items())


def at_layers(prof: Any, layers: int, with_loss: bool = True) -> Any:
    """The same profile for a model of ``layers`` blocks (a pipeline rank's): the traced one's untraced blocks
    follow its per-block line; the analytic one counts its blocks (and its loss only where ``with_loss``)."""
    if isinstance(prof, TracedProfile):
        d = prof.data
        data = {**d, "num_layers": layers}
        if d.get("traced_layers") == d.get("num_layers") and not any(d.get("per_layer") or (0, 0)) \
                and layers != d.get("num_layers") and d.get("num_layers"):
            # traced at full depth (blocks that differ: dense then MoE, sliding then global attention): no
            # per-block line to add or take blocks with, so the average block's (an approximation: which blocks a
            # stage holds is not known here)
            n = d["num_layers"]
            data["per_layer"] = [x // n for x in d["live_after_forward"]]
        return TracedProfile(data, prof.micro_batch, prof.origin)
    return replace(prof, num_layers=layers, **({} if with_loss else {"loss_forward_bytes": 0,
                                                                      "loss_backward_bytes": 0}))


@dataclass(frozen=True)
class HeldProfile:
    """A pipeline rank's activations: its own micro-batch's (``inner``, the profile of its blocks) with what the
    micro-batches still in flight on it hold (``held - 1`` finished forwards, each what a forward leaves saved),
    less ``saved_less`` bytes per micro-batch (sequence parallelism's share of the tensors outside the TP regions,
    on every micro-batch in flight). Every activation figure of the inner profile moves by the same amount."""

    inner: Any
    held: int  #: micro-batches in flight, the current one included
    saved_less: int = 0  #: bytes per micro-batch of 1, each micro-batch in flight
    #: bytes per micro-batch of 1 more in the loss's backward (DTensor's loss_parallel: memplan/parallel/
    #: loss_parallel_extra)
    loss_extra: int = 0
    #: bytes per micro-batch of 1 of the stage's output, which torch.distributed.pipelining keeps from the end of a
    #: micro-batch's forward to its backward (PipelineStage.fwd_cache): on every micro-batch in flight, the one in
    #: its forward excepted
    output: int = 0
    #: the micro-batches held besides the current one, as (profile, count, output) by the stage they ran through
    #: (an interleaved rank's stages differ), each keeping its own stage's output, bytes per micro-batch of 1 (the
    #: last stage's logits on its micro-batches alone); empty: ``held - 1`` of the inner profile's, each keeping
    #: ``output``
    others: tuple = ()
    #: blocks the inner profile counts beyond the current micro-batch's own (an interleaved rank's inner profile
    #: has all its blocks, as its buffers' timeline does; the micro-batch runs through one stage's)
    fewer_layers: int = 0
    #: bytes each held micro-batch's saved tensors count that the micro-batches in flight share, once (autocast's
    #: weight casts, cached for the autocast region a pipeline step runs in)
    shared: int = 0
    #: context parallelism's ring attention (memplan/parallel/context.py ring_attention): bytes per micro-batch of 1 alive
    #: during a block's attention beyond the local kernel's own, in forward (and in a recomputed forward) and in
    #: backward; transients, so on the forward peak and the moments inside a block, not on what is saved
    ring_forward: int = 0
    ring_backward: int = 0
    #: a pipeline rank (torchtitan's layout): its stages in local order (pipeline.StagePart) and its schedule
    #: (pipeline.RankSchedule), what the reserved peak's replay walks (memplan/frameworks/pipeline_replay.py)
    stages: tuple = ()
    actions: Any = None
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    includes_autocast_copies = property(lambda self: self.inner.includes_autocast_copies)

    def extra(self, recompute: str, micro_batch: int) -> int:
        key = ("extra", recompute, micro_batch)
        if key not in self._memo:
            held = outputs = 0
            for prof, count, output in self.others or ((self.inner, self.held - 1, self.output),):
                t = prof.terms(recompute, micro_batch)
                held += count * (t.saved_less_block + t.block)
                outputs += count * output
            block = self.inner.terms(recompute, micro_batch).block
            self._memo[key] = (held - self.held * self.saved_less * micro_batch
                               + (outputs + self.output) * micro_batch - self.fewer_layers * block
                               - (self.held - 1) * self.shared)
        return self._memo[key]

    def fewer(self) -> HeldProfile:
        """The same rank with one micro-batch fewer in flight (one of the held ones gone)."""
        others = self.others
        if others:
            i = max(range(len(others)), key=lambda k: others[k][1])
            prof, count, output = others[i]
            others = others[:i] + ((prof, count - 1, output),) + others[i + 1:]
        return replace(self, held=self.held - 1, others=others, _memo={})

    def terms(self, recompute: str, micro_batch: int) -> Terms:
        fwd, bwd, saved, emb, block = self.inner.terms(recompute, micro_batch)
        x = self.extra(recompute, micro_batch)
        # left at backward's end: the current micro-batch's activations are gone, so neither its share of the
        # sequence-parallel saving nor its output apply; the held micro-batches' do
        end = x + (self.saved_less - self.output) * micro_batch
        return Terms(fwd + x - self.output * micro_batch + self.ring_forward * micro_batch,
                     bwd + x + self.loss_extra * micro_batch + self._ring_inside() * micro_batch, saved + x, emb + end,
                     block)

    @property
    def adds_nothing(self) -> bool:
        """One micro-batch in flight and nothing added to the inner profile's figures."""
        return (self.held == 1 and not (self.saved_less or self.loss_extra or self.output or self.others
                                        or self.fewer_layers or self.shared or self.ring_forward
                                        or self.ring_backward))

    def _ring_inside(self) -> int:
        """The ring's transient inside a block's backward: its backward's, or under recompute its forward's again."""
        return max(self.ring_backward, self.ring_forward if self.recompute != "none" else 0)

    # the timeline's moments: the same shift (the recompute the plan uses is the settings'; these profiles are
    # built per settings, so the recompute is fixed here)
    recompute: str = "none"

    def _x(self, micro_batch: int) -> int:
        return self.extra(self.recompute, micro_batch)

    def block_moments(self, micro_batch: int, grad_width: int, held: bool = False) -> tuple[tuple[int, int], ...]:
        x = self._x(micro_batch) + self._ring_inside() * micro_batch
        return tuple((a + x, g) for a, g in self.inner.block_moments(micro_batch, grad_width, held))

    def block_hooks(self, micro_batch: int) -> tuple:
        x = self._x(micro_batch)
        return tuple(tuple((a + x, g) for a, g in blk) for blk in self.inner.block_hooks(micro_batch))

    def loss_moment(self, micro_batch: int, grad_width: int) -> tuple[int, int] | None:
        m = self.inner.loss_moment(micro_batch, grad_width)
        return None if m is None else (m[0] + self._x(micro_batch) + self.loss_extra * micro_batch, m[1])

    def root_first_hook(self, micro_batch: int) -> tuple[int, int] | None:
        m = self.inner.root_first_hook(micro_batch)
        return None if m is None else (m[0] + self._x(micro_batch) + self.loss_extra * micro_batch, m[1])

    def moment_activations(self, micro_batch: int) -> dict[int, int]:
        x = self._x(micro_batch)
        out = {k: v + x for k, v in self.inner.moment_activations(micro_batch).items()}
        if self.ring_forward and INSIDE_LAST_BLOCK_FORWARD in out:
            out[INSIDE_LAST_BLOCK_FORWARD] += self.ring_forward * micro_batch
        return out

    @property
    def source(self) -> str:
        return self.inner.source + (f"; {self.held} micro-batches in flight" if self.held > 1 else "")
