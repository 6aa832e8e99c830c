"""The tracer's stand-in for scaled_dot_product_attention (memplan/substitutes.py): each call's backend chosen as
the target device chooses it (memplan/kernels.py), a fused backend allocating and saving what that kernel does,
the math kernel running PyTorch's composite with, on a GPU, the measured extra of its CUDA kernels."""

from __future__ import annotations

from typing import Any

from memplan import kernels as K


#: on while the CUDA fused-attention stand-in allocates the kernel's outputs (the output, its logsumexp or
#: statistics and philox state): torchtitan's per-op checkpoint policy keeps those ops' outputs
#: (model/meta_builder.py op_sac_context_fn); a converted mask or the scratch are not outputs
SAC_KERNEL_OUTPUTS = {"on": False}


def _fused(target: K.Target) -> Any:
    """An autograd function that allocates and saves what a fused kernel does on ``target``."""
    import torch

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, mask, backend, call):  # noqa: ANN001
            b, h, s, _ = q.shape
            # the output's memory order (measured on the H100): memory-efficient writes (b, s, h, d) whatever q's
            # layout; flash and cuDNN follow q: (b, s, h, d) for q viewed from a projection's output, (b, h, s, d)
            # for a q made contiguous in that order (GPT-NeoX's rotary cat), which the model's
            # transpose(1, 2).contiguous() then copies
            SAC_KERNEL_OUTPUTS["on"] = target.device == "cuda"
            try:
                if backend == "efficient" or q.stride(1) < q.stride(2):
                    out = torch.empty(b, s, h, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
                else:
                    out = torch.empty(b, h, s, v.shape[-1], dtype=q.dtype, device=q.device)
                extra = []
                for i, (shape, dt) in enumerate(K.saved_extra(backend, call, target.device)):
                    SAC_KERNEL_OUTPUTS["on"] = target.device == "cuda" and i < 3  # a 4th: the converted mask
                    extra.append(torch.empty(shape, dtype=getattr(torch, dt), device=q.device))
            finally:
                SAC_KERNEL_OUTPUTS["on"] = False
            scratch = K.forward_scratch(backend, call, target.device)
            if scratch:
                del_me = torch.empty(scratch, dtype=torch.uint8, device=q.device)
                del del_me
            ctx.backend, ctx.call = backend, call
            ctx.save_for_backward(q, k, v, out, *extra)
            return out

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001
            q, k, v, *_ = ctx.saved_tensors
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            scratch = K.backward_scratch(ctx.backend, ctx.call, target.device)
            if scratch:
                tmp = torch.empty(scratch, dtype=torch.uint8, device=q.device)
                del tmp
            return dq, dk, dv, None, None, None
    return Fused


def _math_extra() -> tuple[Any, Any]:
    """(MathBefore, MathAfter): the extra bytes of the math kernel's CUDA kernels around its composite."""
    import torch

    class MathBefore(torch.autograd.Function):
        """Around the math kernel's composite on a GPU: the bytes its CUDA kernels allocate beyond it
        (kernels.math_extra), alive while the composite runs, forward and backward. Applied to q before the
        composite: its forward allocates the forward's extra (freed by MathAfter's forward), its backward, which
        runs after the composite's, frees the backward's extra (allocated by MathAfter's backward, which runs
        before the composite's)."""

        @staticmethod
        def forward(ctx, q, holder, fwd):  # noqa: ANN001
            holder["fwd"] = torch.empty(fwd, dtype=torch.uint8, device=q.device)
            ctx.holder = holder
            return q.view_as(q)

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001
            ctx.holder.pop("bwd", None)
            return grad, None, None

    class MathAfter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out, holder, bwd):  # noqa: ANN001
            holder.pop("fwd", None)
            ctx.holder, ctx.bwd = holder, bwd
            return out.view_as(out)

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001
            ctx.holder["bwd"] = torch.empty(ctx.bwd, dtype=torch.uint8, device=grad.device)
            return grad, None, None
    return MathBefore, MathAfter


def _call_of(q: Any, k: Any, v: Any, mask: Any, dropout_p: float, is_causal: bool, enable_gqa: bool) -> K.SdpaCall:
    import torch

    dtype_names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                   torch.float64: "float64"}
    mask_kind = None
    if mask is not None:
        mask_kind = "bool" if mask.dtype == torch.bool else "float" if mask.dtype == q.dtype else "float32"
    return K.SdpaCall(dtype=dtype_names.get(q.dtype, "float32"), batch=q.shape[0], hq=q.shape[1],
                      hkv=k.shape[1], sq=q.shape[2], sk=k.shape[2], dq=q.shape[-1], dv=v.shape[-1],
                      mask=mask_kind, mask_shape=tuple(mask.shape) if mask is not None else None,
                      dropout=float(dropout_p), is_causal=bool(is_causal), enable_gqa=bool(enable_gqa))


def sdpa(real_sdpa: Any, target: K.Target, kernels: dict[str, str]):  # noqa: ANN201
    """scaled_dot_product_attention as ``target`` runs it: each call's backend is chosen by memplan.kernels
    (the device's own rules); a fused backend is replaced by a function that allocates and saves what that
    kernel does (kernels.saved_extra, forward_scratch, backward_scratch), the math kernel runs as PyTorch's
    composite (_scaled_dot_product_attention_math) with, on a GPU, the measured extra of its CUDA kernels.
    ``kernels`` collects backend -> why."""
    import torch

    Fused = _fused(target)
    MathBefore, MathAfter = _math_extra()

    def run(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,  # noqa: ANN001
            enable_gqa=False):
        # aten::scaled_dot_product_attention is on autocast's lower-precision list for CUDA and CPU
        # (aten/src/ATen/autocast_mode.cpp): the kernel gets autocast's copies of q, k, v and a float mask, and
        # runs below autocast. This Python stand-in is above the dispatcher, so it casts as autocast would.
        dev = query.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            query, key, value = (t.to(dt) if t.is_floating_point() and t.dtype not in (dt, torch.float64) else t
                                 for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.dtype != dt:
                attn_mask = attn_mask.to(dt)
        call = _call_of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        backend, why = K.backend_for(call, target)
        kernels.setdefault(backend, why)
        with torch.autocast(dev, enabled=False):
            if backend != "math":
                return Fused.apply(query, key, value, attn_mask, backend, call)
            if target.device == "cpu":
                return real_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                 scale=scale, enable_gqa=enable_gqa)
            fwd, bwd = K.math_extra(call)
            holder: dict[str, Any] = {}
            query = MathBefore.apply(query, holder, fwd)
            out = torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
            return MathAfter.apply(out, holder, bwd)

    return run
