"""Activation bytes measured from the real module: transformers' modeling code run on the ``meta`` device.

For a config, the model is built under ``FakeTensorMode`` (meta storage, CPU dispatch, so autocast applies)
at its real size and depth, and one training micro-step (forward, loss, backward) is run at the job's sequence
length for micro-batch 2 and 4. Two instruments watch it:

* ``torch.autograd.graph.saved_tensors_hooks``: the bytes autograd saves for backward, deduplicated by storage,
  parameters excluded;
* a ``TorchDispatchMode`` that follows every storage the step creates until it dies (meta storages keep their
  Python object, so a weakref callback marks the free): the live bytes after forward, and the peaks in forward
  and backward. Parameter gradients are dropped as soon as they are accumulated (the strategy accounts for
  them), so the backward peak is activations and transients only.

Attention kernels: on ``meta`` SDPA would take the math path and save the attention matrix. For ``flash`` and
``sdpa`` (what a GPU runs for causal training, and what the CPU flash kernel does) the call is replaced by a
function that saves what the flash / memory-efficient kernels save: q, k, v, the output and the fp32 logsumexp
[batch, heads, seq] (aten/src/ATen/native/transformers/attention.cpp, _scaled_dot_product_flash_attention).
``eager`` runs transformers' eager attention as written (fp32 softmax, its bf16 cast, dropout mask if any).
``math`` (internal: a CPU job whose attention has dropout; CPU SDPA has no fused kernel with dropout) runs
SDPA unsubstituted on fake CPU tensors, which dispatches to the same math kernel the real CPU run takes.

Recompute ``full`` runs with ``gradient_checkpointing_enable(use_reentrant=False)``: what is live after forward
is then the block inputs, and the backward peak includes one block recomputed.

Every point of the timeline is a line c0 + c1*b in the micro-batch; the profile keeps the upper envelope of
the forward and backward timelines, so a peak at any micro-batch is exact, wherever in the step it falls (the
loss for a large vocabulary, a tied embedding's gradient, a recomputed block). Profiles are cached on disk
(see ``activations.py``).
"""

from __future__ import annotations

import weakref
from typing import Any

from memplan.activations import PROFILE_VERSION
from memplan.errors import SettingsError

class _LiveBytes:
    """Live bytes of the storages created under the mode, op by op.

    Parameter gradients are not activations: when a storage turns out to be a parameter's .grad (seen in the
    post-accumulate hook), its bytes are taken out of the timeline from its creation on.
    """

    def __init__(self) -> None:
        self.live = 0
        self._refs: dict[int, Any] = {}
        self._born: dict[int, int] = {}
        self.timeline: list[int] = [0]
        self._corrections: list[tuple[int, int, int]] = []  # (from index, to index, bytes)

    def track(self, t: Any) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self._refs:
            return
        n = st.nbytes()

        def gone(_ref: Any, key: int = key, n: int = n) -> None:
            self._refs.pop(key, None)
            self._born.pop(key, None)
            self.live -= n

        self._refs[key] = weakref.ref(st, gone)
        self._born[key] = len(self.timeline)
        self.live += n

    def ignore(self, t: Any) -> None:
        """A storage that existed before the step (parameters, buffers): views of it are not new bytes."""
        self._refs[id(t.untyped_storage())] = None

    def tick(self) -> None:
        self.timeline.append(self.live)

    def not_activation(self, t: Any) -> None:
        """``t`` is a parameter gradient: remove it from the timeline since it was created."""
        st = t.untyped_storage()
        born = self._born.get(id(st))
        if born is not None:
            self._corrections.append((born, len(self.timeline) + 1, st.nbytes()))
            self._born.pop(id(st), None)

    def corrected(self) -> list[int]:
        diff = [0] * (len(self.timeline) + 2)
        for a, b, n in self._corrections:
            diff[a] -= n
            diff[min(b, len(self.timeline))] += n
        out, run = [], 0
        for i, v in enumerate(self.timeline):
            run += diff[i]
            out.append(v + run)
        return out


def _mode(live: _LiveBytes) -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    live.track(t)
            live.tick()
            return out

    return Mode()


def _flash_sdpa():
    """scaled_dot_product_attention that saves what flash / memory-efficient kernels save."""
    import torch

    class FlashLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):  # noqa: ANN001
            b, h, s, _ = q.shape
            # flash and memory-efficient kernels (CUDA and CPU) write the output in (batch, seq, heads, dim)
            # memory order and return it transposed, so the model's transpose(1, 2).contiguous() copies nothing
            out = torch.empty(b, s, h, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
            lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001
            q, k, v, out, lse = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,  # noqa: ANN001
             enable_gqa=False):
        # aten::scaled_dot_product_attention is on autocast's lower-precision list for CUDA and CPU
        # (aten/src/ATen/autocast_mode.cpp), so under torch-amp the real kernel gets bf16 copies of q, k, v
        # (llama's rotary embedding makes q and k fp32) and saves those, and returns bf16. This Python stand-in
        # is below the autocast dispatch, so cast here as autocast would (measured: without it a llama block
        # under torch-amp was over-counted by 4 x s*b*h bytes).
        dev = query.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            query, key, value = (t.to(dt) if t.is_floating_point() and t.dtype != torch.float64 else t
                                 for t in (query, key, value))
        return FlashLike.apply(query, key, value)

    return sdpa


def _cuda_dropout():
    """F.dropout as CUDA runs it in training: at::dropout takes the fused native_dropout kernel on CUDA
    (aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable), which saves a bool mask, 1 byte per element.
    On CPU, _dropout multiplies by a noise tensor in the input's dtype and saves that (2 or 4 bytes), and the
    fake-tensor trace follows the CPU path; so a GPU job's trace swaps this in."""
    import torch

    class BoolMaskDropout(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001
            ctx.save_for_backward(torch.empty(x.shape, dtype=torch.bool, device=x.device))
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001
            (mask,) = ctx.saved_tensors
            return torch.empty_like(grad)

    def dropout(input, p=0.5, training=True, inplace=False):  # noqa: ANN001, A002
        if not training or p == 0:
            return input
        return BoolMaskDropout.apply(input)

    return dropout


def _one_step(config: dict[str, Any], batch: int, seq: int, recipe: str, attention: str,
              recompute: str, device: str = "cuda") -> dict[str, Any]:
    """Trace one micro-step of ``batch`` sequences of ``seq`` tokens: the live-bytes timeline, op by op."""
    import torch
    import torch.nn.functional as F
    import transformers.masking_utils as mu
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from memplan.model.meta_builder import hf_config

    dtype, autocast = _RECIPE_TRACE[recipe]
    cfg = hf_config(config)
    impl = "eager" if attention == "eager" else "sdpa"
    import logging

    import transformers

    real_sdpa = F.scaled_dot_product_attention
    real_dropout = F.dropout
    # fake-tensor kernels that refuse an input log a traceback before raising; the raise is what we report
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_level, tf_level = fake_log.level, transformers.logging.get_verbosity()
    fake_log.setLevel(logging.CRITICAL)
    transformers.logging.set_verbosity_error()
    # packed-sequence detection reads values (.item()), which fake tensors do not have: one unpacked sequence
    real_packed = getattr(mu, "find_packed_sequence_indices", None)
    try:
        if attention in ("flash", "sdpa"):
            F.scaled_dot_product_attention = _flash_sdpa()
        if device == "cuda":
            F.dropout = _cuda_dropout()
        if real_packed is not None:
            mu.find_packed_sequence_indices = lambda position_ids: None
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=getattr(torch, dtype))
            if recompute == "full":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            params = list(model.parameters())
            live = _LiveBytes()
            for t in params + list(model.buffers()):
                live.ignore(t)
            param_storages = {id(p.untyped_storage()) for p in params}

            def drop_grad(p: Any) -> None:
                live.not_activation(p.grad)
                p.grad = None

            for p in params:
                p.register_post_accumulate_grad_hook(drop_grad)
            saved: dict[int, int] = {}

            def pack(t: Any) -> Any:
                st = t.untyped_storage()
                if id(st) not in param_storages:
                    saved.setdefault(id(st), st.nbytes())
                return t

            ids = torch.zeros(batch, seq, dtype=torch.long)
            with _mode(live):
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        loss = model(input_ids=ids, labels=ids).loss
                live.tick()
                forward_end = len(live.timeline)
                after_forward = live.live
                loss.backward()
                live.tick()
                del loss
    finally:
        fake_log.setLevel(fake_level)
        transformers.logging.set_verbosity(tf_level)
        F.scaled_dot_product_attention = real_sdpa
        F.dropout = real_dropout
        if real_packed is not None:
            mu.find_packed_sequence_indices = real_packed
    timeline = live.corrected()
    return {"saved": sum(saved.values()), "live": after_forward, "forward": timeline[:forward_end],
            "backward": timeline[forward_end - 1:]}


#: recipe -> (dtype the model is traced in, autocast to bf16) — what the matmuls and the residual stream see
_RECIPE_TRACE = {"deepspeed-bf16": ("bfloat16", False), "deepspeed-fp16": ("float16", False),
                 "fsdp-bf16": ("bfloat16", False), "pure-bf16": ("bfloat16", False),
                 "torch-amp": ("float32", True), "fp32": ("float32", False)}


def _envelope(lines: list[tuple[int, int]]) -> list[list[int]]:
    """The lines (c0 + c1*b) that are the maximum for some micro-batch b >= 1 (upper envelope)."""
    best: dict[int, int] = {}
    for c0, c1 in lines:
        if best.get(c1, c0 - 1) < c0:
            best[c1] = c0
    pts = sorted(best.items())  # by slope c1
    keep: list[tuple[int, int]] = []
    for c1, c0 in pts:
        # drop lines below this one for every b >= 1 (smaller slope and smaller value at b=1)
        while keep and keep[-1][1] + keep[-1][0] <= c0 + c1:
            keep.pop()
        keep.append((c1, c0))
    return [[c0, c1] for c1, c0 in keep]


_HETEROGENEOUS_KEYS = ("first_k_dense_replace", "layer_types", "mlp_only_layers", "decoder_sparse_step",
                       "moe_layer_freq", "sliding_window_pattern")


def trace_profile(config: dict[str, Any], *, seq_len: int, recipe: str, attention: str,
                  recompute: str, device: str = "cuda") -> dict[str, Any]:
    """The activation profile of one micro-step at ``seq_len``, as lines c0 + c1*b in the micro-batch b.

    Traced with 1 and 2 blocks (all blocks alike) or at full depth (blocks that differ: dense then MoE,
    sliding then global attention), each for b = 2 and b = 4 (b = 1 takes shortcuts such as squeezes, so its
    timeline has other operations). Every timeline point is a line in b; what does not scale with the batch
    (autocast's weight copies, a tied embedding's partial gradient) lands in c0. A model of L blocks adds
    (L - traced) x the per-block bytes to every peak: exact when the peak falls while every block's activations
    are alive (forward end, loss, early backward), an upper bound when it falls late in backward.
    """
    import transformers

    from memplan.harness.spec import scale_config

    if recipe not in _RECIPE_TRACE:
        raise SettingsError(f"cannot trace activations for precision {recipe}")
    key = next((k for k in ("num_hidden_layers", "n_layer", "num_layers") if config.get(k)), None)
    if key is None:
        raise SettingsError("the config has no layer count; use --activations analytic")
    layers = int(config[key])
    # blocks that differ are traced at full depth; a one-block model too (there is no second depth to subtract)
    heterogeneous = layers < 2 or any(config.get(k) for k in _HETEROGENEOUS_KEYS)

    def run(depth: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
        cfg = scale_config(config, layers=depth)[0] if depth else config
        a = _one_step(cfg, 2, seq_len, recipe, attention, recompute, device)
        b = _one_step(cfg, 4, seq_len, recipe, attention, recompute, device)
        if len(a["forward"]) != len(b["forward"]) or len(a["backward"]) != len(b["backward"]):
            raise SettingsError("the traced step runs different operations at micro-batch 2 and 4; "
                                "use --activations analytic")
        return a, b

    try:
        if heterogeneous:
            top = run(None)
            low = None
        else:
            low, top = run(1), run(2)
    except SettingsError:
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise SettingsError(f"tracing activations failed ({type(exc).__name__}: {first[:200]}); "
                            "use --activations analytic") from None

    def line(a: int, b: int) -> list[int]:
        slope = (b - a) // 2
        if slope * 2 != b - a:
            raise SettingsError("traced activation bytes are not linear in the micro-batch; "
                                "use --activations analytic")
        return [a - 2 * slope, slope]

    def envelope(key: str) -> list[list[int]]:
        return _envelope([tuple(line(a, b)) for a, b in zip(top[0][key], top[1][key])])  # type: ignore[misc]

    live = line(top[0]["live"], top[1]["live"])
    per_layer = [0, 0] if low is None else [x - y for x, y in zip(live, line(low[0]["live"], low[1]["live"]))]
    return {
        "version": PROFILE_VERSION,
        "seq_len": seq_len, "recipe": recipe, "attention": attention, "recompute": recompute, "device": device,
        "num_layers": layers, "traced_layers": layers if heterogeneous else 2,
        "live_after_forward": live,  #: at the traced depth
        "per_layer": per_layer,  #: one more block (zero when traced at full depth)
        "saved_for_backward": line(top[0]["saved"], top[1]["saved"]),
        "forward_peak": envelope("forward"),
        "backward_peak": envelope("backward"),
        "transformers": transformers.__version__,
    }

