"""The tracer's stand-in for scaled_dot_product_attention (memplan/activations/substitutes.py): each call's backend chosen as
the target device chooses it (memplan/activations/kernels.py), a fused backend allocating and saving what that kernel does,
the math kernel running PyTorch's composite with, on a GPU, the measured extra of its CUDA kernels."""

from __future__ import annotations

from typing import Any

from memplan.activations import kernels as K


#: on while the CUDA fused-attention stand-in allocates the kernel's outputs (the output, its logsumexp or
#: statistics and philox state): torchtitan's per-op checkpoint policy keeps those ops' outputs
#: (model/meta_builder.py op_sac_context_fn); a converted mask or the scratch are not outputs
SAC_KERNEL_OUTPUTS = {"on": False}


def _extras(backend: str, call: K.SdpaCall, target: K.Target, device: Any, lo: int = 0,
            hi: int | None = None) -> list[Any]:
    """What a fused kernel saves beside q, k, v and its output (SdpaBackend.saved [lo:hi]), allocated."""
    import torch

    return [torch.empty(shape, dtype=getattr(torch, dt), device=device)
            for shape, dt in K.BACKENDS[backend].saved(call, target.device)[lo:hi]]


def _scratch(nbytes: int, device: Any) -> None:
    """A kernel's scratch: allocated and freed before it returns."""
    if nbytes:
        import torch

        tmp = torch.empty(nbytes, dtype=torch.uint8, device=device)
        del tmp


def _forward_outputs(q: Any, v: Any, backend: str, call: K.SdpaCall, target: K.Target) -> tuple[Any, list[Any]]:
    """A fused kernel's output and what it saves beside q, k, v, allocated in the kernel's order."""
    import torch

    b, h, s, _ = q.shape
    # the output's memory order (measured on the H100): memory-efficient writes (b, s, h, d) whatever q's
    # layout; flash and cuDNN follow q: (b, s, h, d) for q viewed from a projection's output, (b, h, s, d)
    # for a q made contiguous in that order (GPT-NeoX's rotary cat), which the model's
    # transpose(1, 2).contiguous() then copies
    SAC_KERNEL_OUTPUTS["on"] = target.device == "cuda"
    try:
        if K.BACKENDS[backend].output_bshd or q.stride(1) < q.stride(2):
            out = torch.empty(b, s, h, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
        else:
            out = torch.empty(b, h, s, v.shape[-1], dtype=q.dtype, device=q.device)
        extra = _extras(backend, call, target, q.device, 0, 3)  # the kernel's outputs
        SAC_KERNEL_OUTPUTS["on"] = False  # a 4th: the converted mask
        extra += _extras(backend, call, target, q.device, 3)
    finally:
        SAC_KERNEL_OUTPUTS["on"] = False
    return out, extra


def _backward_outputs(q: Any, k: Any, v: Any, call: K.SdpaCall, mask_dtype: Any, mask_grad: bool) -> list[Any]:
    """dq, dk, dv and, for a mask that requires grad, the bias gradient as the kernel allocates it."""
    import torch

    out = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    if mask_grad:
        # a learned bias (T5's relative positions) takes the memory-efficient kernel (cuDNN and flash refuse
        # a mask that requires grad), whose backward makes the bias's gradient beside dq, dk, dv: the
        # expanded bias's sizes with the last dim rounded up to 16, sliced back (attention_backward.cu
        # _efficient_attention_backward, bias_requires_grad); autograd sums it to the mask's own shape
        c = call
        out.append(torch.empty(c.batch, c.hq, c.sq, -(-c.sk // 16) * 16, dtype=mask_dtype, device=q.device))
    return out


def _backward_transients(backend: str, call: K.SdpaCall, target: K.Target, device: Any) -> None:
    """What a fused kernel's backward allocates for itself after dq, dk, dv, freed before it returns."""
    import torch

    order = K.BACKENDS[backend].backward_allocations(call, target.device, target.arch)
    if order is not None:
        # e.g. memory-efficient's delta, the temporaries that make it and its workspace, in order
        temps, delta, work = order
        held = [torch.empty(n, dtype=torch.uint8, device=device) for n in temps]
        d = torch.empty(delta, dtype=torch.uint8, device=device)
        del held
        w = torch.empty(work, dtype=torch.uint8, device=device) if work else None
        del d, w
    else:
        _scratch(K.BACKENDS[backend].backward_scratch(call, target.device, target.arch), device)


def fused_kernel(target: K.Target) -> Any:
    """An autograd function that allocates and saves what a fused kernel does on ``target``."""
    import torch

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, mask, backend, call):  # noqa: ANN001
            out, extra = _forward_outputs(q, v, backend, call, target)
            _scratch(K.BACKENDS[backend].forward_scratch(call, target.device), q.device)
            ctx.backend, ctx.call = backend, call
            ctx.mask_dtype = mask.dtype if mask is not None else q.dtype
            ctx.save_for_backward(q, k, v, out, *extra)
            return out

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001
            q, k, v, *_ = ctx.saved_tensors
            grads = _backward_outputs(q, k, v, ctx.call, ctx.mask_dtype,
                                      ctx.call.mask_grad and ctx.needs_input_grad[3])
            dmask = grads[3][..., :ctx.call.sk] if len(grads) > 3 else None
            _backward_transients(ctx.backend, ctx.call, target, q.device)
            return grads[0], grads[1], grads[2], dmask, None, None
    return Fused


#: torch.compile's attention (tracing/compiled.py): each stand-in's target device, by the key its calls carry
_SITES: dict[str, K.Target] = {}
_OPS: dict[str, Any] = {}


def _site_call(q: Any, k: Any, v: Any, mask: Any, dropout_p: float, is_causal: bool, enable_gqa: bool,
               mask_grad: bool, site: str) -> tuple[str, K.SdpaCall, K.Target]:
    from dataclasses import replace

    target = _SITES[site]
    call = replace(_call_of(q, k, v, mask, dropout_p, is_causal, enable_gqa), mask_grad=mask_grad)
    return K.backend_for(call, target)[0], call, target


def compiled_ops() -> dict[str, Any]:
    """The fused attention kernel as two operators (memplan::attention and its backward) that torch.compile
    keeps whole, as it keeps aten's flash, memory-efficient and cuDNN attention (extern kernels the partitioner
    saves the inputs and outputs of); their fake kernels allocate what the fused stand-in above does, and
    ``after`` runs each one's scratch after it in a compiled graph (tracing/compiled.py)."""
    if _OPS:
        return _OPS
    import torch

    args = "float dropout_p, bool is_causal, bool enable_gqa, bool mask_grad, str site"

    @torch.library.custom_op("memplan::attention", mutates_args=(),
                             schema=f"(Tensor q, Tensor k, Tensor v, Tensor? mask, {args}) -> Tensor[]")
    def attention(q, k, v, mask, dropout_p, is_causal, enable_gqa, mask_grad, site):  # noqa: ANN001, ANN202
        raise RuntimeError("memplan::attention runs on the trace's fake tensors only")

    @attention.register_fake
    def _(q, k, v, mask, dropout_p, is_causal, enable_gqa, mask_grad, site):  # noqa: ANN001, ANN202
        backend, call, target = _site_call(q, k, v, mask, dropout_p, is_causal, enable_gqa, mask_grad, site)
        out, extra = _forward_outputs(q, v, backend, call, target)
        return [out, *extra]

    @torch.library.custom_op("memplan::attention_backward", mutates_args=(),
                             schema="(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor[] saved, "
                                    f"{args}) -> Tensor[]")
    def attention_backward(grad, q, k, v, mask, saved, dropout_p, is_causal, enable_gqa, mask_grad,  # noqa: ANN001, ANN202
                           site):
        raise RuntimeError("memplan::attention_backward runs on the trace's fake tensors only")

    @attention_backward.register_fake
    def _(grad, q, k, v, mask, saved, dropout_p, is_causal, enable_gqa, mask_grad, site):  # noqa: ANN001, ANN202
        _, call, _ = _site_call(q, k, v, mask, dropout_p, is_causal, enable_gqa, mask_grad, site)
        return _backward_outputs(q, k, v, call, mask.dtype if mask is not None else q.dtype, mask_grad)

    def setup_context(ctx, inputs, output):  # noqa: ANN001, ANN202
        q, k, v, mask, dropout_p, is_causal, enable_gqa, mask_grad, site = inputs
        ctx.args = (dropout_p, is_causal, enable_gqa, mask_grad, site)
        ctx.has_mask = mask is not None
        ctx.save_for_backward(q, k, v, mask, *output)

    def backward(ctx, grads):  # noqa: ANN001, ANN202
        q, k, v, mask, *saved = ctx.saved_tensors
        out = attention_backward(grads[0], q, k, v, mask if ctx.has_mask else None, saved, *ctx.args)
        dmask = out[3][..., :k.shape[2]] if len(out) > 3 else None
        return out[0], out[1], out[2], dmask, None, None, None, None, None

    attention.register_autograd(backward, setup_context=setup_context)

    def after_forward(args: tuple, _out: Any) -> None:
        q, k, v, mask, dropout_p, is_causal, enable_gqa, mask_grad, site = args
        backend, call, target = _site_call(q, k, v, mask, dropout_p, is_causal, enable_gqa, mask_grad, site)
        _scratch(K.BACKENDS[backend].forward_scratch(call, target.device), q.device)

    def after_backward(args: tuple, _out: Any) -> None:
        _, q, k, v, mask, _, dropout_p, is_causal, enable_gqa, mask_grad, site = args
        backend, call, target = _site_call(q, k, v, mask, dropout_p, is_causal, enable_gqa, mask_grad, site)
        _backward_transients(backend, call, target, q.device)

    _OPS.update({"attention": torch.ops.memplan.attention.default,
                 "after": {torch.ops.memplan.attention.default: after_forward,
                           torch.ops.memplan.attention_backward.default: after_backward}})
    return _OPS


def _ring(target: K.Target, cp: int) -> Any:
    """Context parallelism: one CP rank's attention as torch's ring attention runs it over ``cp`` ranks
    (torch/distributed/tensor/experimental/_context_parallel/_attention.py, torch 2.13, its defaults: the all-gather
    rotation, fp32 merge and accumulators, load balancing), on its local q, k, v (seq / cp tokens), with every
    collective's output a new buffer of its size. Forward (_templated_ring_attention): k and v made contiguous
    (copies of the model's transposed views) and concatenated, all-gathered once (cp x that); each of the cp steps
    runs the fused kernel (its output and what it saves beside it: SdpaBackend.saved) and the merger
    (_SDPAMerger) converts both to fp32 and folds them in (out - sigmoid(lse_i - lse) * (out - out_i)); the result
    cast back is the output, saved with q, k, v and the kernel's extras as the aten op saves them. Backward
    (_templated_ring_attention_backward): fp32 accumulators of dq, dk, dv, k and v contiguous, concatenated and
    all-gathered again, and per step the kernel's dq, dk, dv, their fp32 sums, the accumulated dk, dv concatenated
    in fp32 and passed on (the all-to-all rotation's permute: a new buffer); at the end dq cast back and the last
    received dk, dv cast back. Each step at the whole local sequence (load balancing halves some steps' q or k/v:
    an upper bound). Measured with the CPU harness (harness/cp.py: the same functions with the CPU flash kernel)."""
    import torch
    import torch.nn.functional as F

    class Ring(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, mask, backend, call):  # noqa: ANN001
            def kernel() -> tuple[Any, list[Any]]:
                out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
                extra = _extras(backend, call, target, q.device)
                _scratch(K.BACKENDS[backend].forward_scratch(call, target.device), q.device)
                return out, extra

            kc, vc = k.contiguous(), v.contiguous()
            next_kv = torch.cat([kc.flatten(), vc.flatten()])
            gathered = torch.empty(cp * next_kv.numel(), dtype=k.dtype, device=k.device)
            merged = lse = None
            for i in range(cp):
                if i == 1:
                    del next_kv  # the loop's variable now views the gathered buffer
                out_i, extra_i = kernel()
                o32 = out_i.to(torch.float32)
                l32 = extra_i[0].to(torch.float32).unsqueeze(-1) if extra_i and extra_i[0].dim() == 3 else None
                del out_i, extra_i
                if merged is None:
                    merged, lse = o32, l32
                else:
                    merged = merged - F.sigmoid(l32 - lse) * (merged - o32) if l32 is not None else merged - o32
                    lse = lse - F.logsigmoid(lse - l32) if l32 is not None else lse
                del o32, l32
            del gathered, kc, vc
            # the op's outputs (what torchtitan's per-op checkpoint policy keeps: the aten op is the same under CP)
            SAC_KERNEL_OUTPUTS["on"] = target.device == "cuda"
            try:
                out = merged.to(q.dtype)
                extra = _extras(backend, call, target, q.device, 0, 3)
            finally:
                SAC_KERNEL_OUTPUTS["on"] = False
            del merged, lse
            ctx.backend, ctx.call = backend, call
            ctx.save_for_backward(q, k, v, out, *extra)
            return out

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001
            q, k, v, *_ = ctx.saved_tensors
            f32 = torch.float32
            dq, dk, dv = (torch.zeros_like(t, dtype=f32) for t in (q, k, v))
            kc, vc = k.contiguous(), v.contiguous()
            next_kv = torch.cat([kc.flatten(), vc.flatten()])
            gathered = torch.empty(cp * next_kv.numel(), dtype=k.dtype, device=k.device)
            passed = None
            for i in range(cp):
                if i == 1:
                    del next_kv
                dq_i, dk_i, dv_i = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                # a load-balanced step on half the query (i > rank) hands the kernel q.chunk(2)[1], which the CPU
                # flash kernel copies to make contiguous (measured: rank 0 of cp 2 in fp32 held one more, -1.78%)
                half = torch.empty_like(q) if target.device == "cpu" and i else None
                _scratch(K.BACKENDS[ctx.backend].backward_scratch(ctx.call, target.device, target.arch), q.device)
                if passed is not None:  # the accumulated dk, dv received from the previous rank
                    dk, dv = (passed[:dk.numel()].view(dk.shape), passed[dk.numel():].view(dv.shape))
                dk = dk + dk_i.to(f32)
                dv = dv + dv_i.to(f32)
                send = torch.cat([dk.flatten(), dv.flatten()])
                passed = torch.empty_like(send)  # the permute's output
                del send
                dq = dq + dq_i.to(f32)
                del dq_i, dk_i, dv_i, half
            del gathered, kc, vc
            dq_out = dq.to(q.dtype)
            del dq
            back = passed.to(k.dtype)
            del passed, dk, dv
            return dq_out, back[:k.numel()].view(k.shape), back[k.numel():].view(v.shape), None, None, None
    return Ring


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
                      dropout=float(dropout_p), is_causal=bool(is_causal), enable_gqa=bool(enable_gqa),
                      mask_grad=bool(mask is not None and mask.requires_grad and torch.is_grad_enabled()))


def _autocast_inputs(q: Any, k: Any, v: Any, mask: Any) -> tuple[Any, Any, Any, Any]:
    """q, k, v and the mask as autocast hands them to the kernel: aten::scaled_dot_product_attention is on
    autocast's lower-precision list for CUDA and CPU (aten/src/ATen/autocast_mode.cpp), so the kernel gets
    autocast's copies of q, k, v and a float mask and runs below autocast. The stand-ins are above the dispatcher,
    so they cast as autocast would."""
    import torch

    dev = q.device.type
    if not torch.is_autocast_enabled(dev):
        return q, k, v, mask
    dt = torch.get_autocast_dtype(dev)
    q, k, v = (t.to(dt) if t.is_floating_point() and t.dtype not in (dt, torch.float64) else t for t in (q, k, v))
    if mask is not None and mask.is_floating_point() and mask.dtype != dt:
        mask = mask.to(dt)
    return q, k, v, mask


def sdpa(real_sdpa: Any, target: K.Target, kernels: dict[str, str], cp: int = 1,  # noqa: ANN201
         compiled: bool = False):
    """scaled_dot_product_attention as ``target`` runs it: each call's backend is chosen by memplan.activations.kernels
    (the device's own rules); a fused backend is replaced by a function that allocates and saves what that
    kernel does (kernels.SdpaBackend: saved, forward_scratch, backward_scratch), the math kernel runs as PyTorch's
    composite (_scaled_dot_product_attention_math) with, on a GPU, the measured extra of its CUDA kernels.
    ``kernels`` collects backend -> why. ``compiled``: under torch.compile, a fused kernel is one operator
    (compiled_ops) that the compiled graphs keep whole."""
    import torch

    if compiled:
        if cp > 1:
            raise ValueError("--compile with context parallelism is not modelled")
        site = repr((target, len(_SITES)))
        _SITES[site] = target
        op = compiled_ops()["attention"]

        # run by dynamo while it traces (a constant to it): the kernel chosen is recorded once, and the compiled
        # code holds no guard on the record's contents (which would compile again when it changes)
        @torch._dynamo.assume_constant_result
        def record(backend: str, why: str) -> bool:
            kernels.setdefault(backend, why)
            return True

        def run_compiled(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,  # noqa: ANN001
                         enable_gqa=False):
            dev = query.device.type
            query, key, value, attn_mask = _autocast_inputs(query, key, value, attn_mask)
            mask_grad = attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled()
            call = _call_of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
            backend, why = K.backend_for(call, target)
            record(backend, why)
            with torch.autocast(dev, enabled=False):
                if not K.BACKENDS[backend].fused:
                    # the math kernel is PyTorch's composite: its operators go into the graph, and inductor
                    # fuses and partitions them like the rest (a GPU's math kernels' own extra is not modelled)
                    return torch.ops.aten._scaled_dot_product_attention_math(
                        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
                return op(query, key, value, attn_mask, float(dropout_p), bool(is_causal), bool(enable_gqa),
                          bool(mask_grad), site)[0]

        return run_compiled

    Fused = fused_kernel(target) if cp == 1 else _ring(target, cp)
    MathBefore, MathAfter = _math_extra()

    def run(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,  # noqa: ANN001
            enable_gqa=False):
        dev = query.device.type
        query, key, value, attn_mask = _autocast_inputs(query, key, value, attn_mask)
        call = _call_of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        backend, why = K.backend_for(call, target)
        kernels.setdefault(backend, why)
        with torch.autocast(dev, enabled=False):
            if cp > 1 and attn_mask is not None:
                raise ValueError("context parallelism runs torch's ring attention, which takes causal attention "
                                 "without a mask; this model's attention passes one (a sliding window or padding)")
            if K.BACKENDS[backend].fused:
                return Fused.apply(query, key, value, attn_mask, backend, call)
            if cp > 1:
                raise ValueError(f"context parallelism needs a fused attention kernel; this call runs math ({why})")
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
