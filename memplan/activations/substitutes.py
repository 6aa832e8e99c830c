"""Kernel substitutions for the traced step: where the target device would run something other than what fake
CPU tensors run, the trace runs a stand-in that allocates and saves what the real kernel does.

The step is traced on fake CPU tensors (FakeTensorMode): a CPU-only PyTorch cannot record autograd for fake
CUDA tensors (AccumulateGrad's InputMetadata asks for a CUDA device guard). So for a GPU job:

* ``CudaAutocast``: CPU autocast with CUDA's policy, op by op, taken from the installed PyTorch's own
  AutocastCUDA kernels (aten/src/ATen/autocast_mode.cpp);
* ``sdpa``: scaled_dot_product_attention as the device's backend choice runs it (memplan.activations.kernels);
* ``cuda_dropout``: the fused dropout's 1-byte mask;
* ``cuda_scratch``: what CUDA kernels allocate for themselves after their output (a reduction's staging buffer,
  an embedding backward's partial sums), as the trace's dispatch mode records each op.

For a CPU job, ``gemm_scratch`` adds oneDNN's bf16 GEMM scratch for the host's instruction set. DeepSpeed
ZeRO-3's own linear (``deepspeed_zero3_linear``) is substituted for both.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from memplan.activations import kernels as K
from memplan.activations.substitutes_sdpa import sdpa  # noqa: F401  (the tracer's name for it)

# ---- CUDA autocast on CPU tensors ----------------------------------------------------------------------------


class CudaAutocast:
    """While active, CPU autocast casts as CUDA autocast does.

    Every op with an AutocastCUDA or AutocastCPU kernel gets a Python AutocastCPU kernel. On its first call with
    a given signature it runs the op's AutocastCUDA kernel on fake CUDA copies of the arguments (no autograd, so
    a CPU-only build runs them) and records what that kernel did: which inputs it cast to which dtype (its
    ``_to_copy`` calls), and whether it ran the op in fp32 through a dtype argument (the fp32_set_opt_dtype and
    fp32_append_dtype policies: softmax, log_softmax, sum, norm...). It then does the same to the CPU
    arguments, with autocast's weight-cast cache (cached_cast: a leaf fp32 tensor that requires grad is cast
    once per autocast region), and runs the op below autocast. Measured against real CUDA autocast on the H100
    (torch 2.11): the same output dtype for 45 of 46 ops probed, the exception being grouped_mm in fp32, which
    the trace does not run (memplan/activations/tracing/)."""

    def __init__(self, dtype: str = "bfloat16") -> None:
        self.dtype_name = dtype
        self._policies: dict[Any, Any] = {}
        self._cache: dict[int, Any] = {}

    def __enter__(self) -> CudaAutocast:
        import warnings

        import torch

        self.torch = torch
        self.dtype = getattr(torch, self.dtype_name)
        names = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
        names |= set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))
        self.lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            for name in sorted(names):
                op = _op(name)
                if op is not None:
                    self.lib.impl(name.removeprefix("aten::"), self._kernel(op), "AutocastCPU")
        self._clear = torch.clear_autocast_cache

        def clear() -> None:
            self._cache.clear()
            self._clear()

        torch.clear_autocast_cache = clear
        return self

    def __exit__(self, *exc: Any) -> None:
        self.torch.clear_autocast_cache = self._clear
        self.lib._destroy()
        self._cache.clear()

    def _kernel(self, op: Any):  # noqa: ANN202
        torch = self.torch
        exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            casts, dtype_arg = self._policy(op, args, kwargs)
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                if casts or dtype_arg:
                    args, kwargs = self._apply(op, args, kwargs, casts, dtype_arg)
                return op(*args, **kwargs)

        return kernel

    def _signature(self, op: Any, args: Any, kwargs: Any) -> tuple:
        from torch.utils._pytree import tree_leaves

        torch = self.torch
        return (op, tuple(str(t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                          for t in tree_leaves((args, kwargs))), tuple(sorted(kwargs)))

    def _policy(self, op: Any, args: Any, kwargs: Any) -> tuple[dict[int, Any], Any]:
        key = self._signature(op, args, kwargs)
        hit = self._policies.get(key)
        if hit is None:
            hit = self._policies[key] = self._probe(op, args, kwargs)
        return hit

    def _probe(self, op: Any, args: Any, kwargs: Any) -> tuple[dict[int, Any], Any]:
        """Run the AutocastCUDA kernel on fake CUDA copies: ({leaf index: dtype}, dtype it forced or None)."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import (
            TorchDispatchMode,
            _disable_current_modes,
        )
        from torch.utils._pytree import tree_flatten, tree_unflatten

        torch = self.torch
        leaves, spec = tree_flatten((args, kwargs))
        casts: dict[int, Any] = {}
        with _disable_current_modes(), FakeTensorMode(allow_non_fake_inputs=True):
            cuda = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                    if isinstance(t, torch.Tensor) else t for t in leaves]
            index = {id(t): i for i, t in enumerate(cuda) if isinstance(t, torch.Tensor)}

            class Record(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, a=(), kw=None):  # noqa: ANN001
                    kw = kw or {}
                    if func is torch.ops.aten._to_copy.default and id(a[0]) in index and "dtype" in kw:
                        casts.setdefault(index[id(a[0])], kw["dtype"])
                    return func(*a, **kw)

            cargs, ckwargs = tree_unflatten(cuda, spec)
            prev_on, prev_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", self.dtype)
            torch.autocast_increment_nesting()
            try:
                with Record():
                    with_autocast = op(*cargs, **ckwargs)
            except Exception:
                return {}, None  # the op has no fake CUDA kernel: leave the call as it is
            finally:
                torch.autocast_decrement_nesting()
                torch.set_autocast_enabled("cuda", prev_on)
                torch.set_autocast_dtype("cuda", prev_dtype)
                # the real cache only (what the fake CUDA run cached): the patched torch.clear_autocast_cache
                # would also empty this region's weight casts, which the trace must keep until the region exits
                self._clear()
            # the same casts without autocast: a different output dtype means the kernel set a dtype argument
            cast = [t.to(casts[i]) if i in casts else t for i, t in enumerate(cuda)]
            cargs, ckwargs = tree_unflatten(cast, spec)
            try:
                without = op(*cargs, **ckwargs)
            except Exception:
                return casts, None
        out_a = [t for t in tree_flatten(with_autocast)[0] if isinstance(t, torch.Tensor)]
        out_b = [t for t in tree_flatten(without)[0] if isinstance(t, torch.Tensor)]
        forced = None
        if out_a and out_b and out_a[0].dtype != out_b[0].dtype:
            forced = out_a[0].dtype
        return casts, forced

    def _apply(self, op: Any, args: Any, kwargs: Any, casts: dict[int, Any], forced: Any) -> tuple[Any, Any]:
        from torch.utils._pytree import tree_flatten, tree_unflatten

        torch = self.torch
        leaves, spec = tree_flatten((args, kwargs))
        out = list(leaves)
        # in the order the AutocastCUDA kernel cast them (the probe's record: right to left, as the compiled
        # kernels evaluate their calls' arguments; lab/probes/autocast_cast_order.py): linear's bias, weight, input
        for i, dtype in casts.items():
            t = out[i] if i < len(out) else None
            if isinstance(t, torch.Tensor) and t.dtype != dtype:
                out[i] = self._cast(t, dtype)
        if forced is not None and not any(a.name == "dtype" for a in op._schema.arguments):
            # an op without a dtype argument whose output autocast changed (fp32-policy ops such as
            # cross_entropy_loss on bf16 logits, autocast_mode.cpp KERNEL_CUDA(..., fp32)): autocast cast its
            # floating inputs (cached_cast(at::kFloat, ...)), which the probe did not see one by one
            for i, t in enumerate(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != forced:
                    out[i] = self._cast(t, forced)
            return tree_unflatten(out, spec)
        args, kwargs = tree_unflatten(out, spec)
        if forced is not None:
            kwargs = dict(kwargs, dtype=forced)
        return args, kwargs

    def _cast(self, t: Any, dtype: Any) -> Any:
        """autocast's cached_cast (aten/src/ATen/autocast_mode.cpp): a leaf fp32 tensor that requires grad (a
        weight) is cast to the lower precision once per autocast region."""
        torch = self.torch
        cacheable = (dtype == self.dtype and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                     and not t._is_view() and torch.is_autocast_cache_enabled())
        if not cacheable:
            return t.to(dtype)
        hit = self._cache.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        out = t.to(dtype)
        self._cache[id(t)] = (weakref.ref(t), out)
        return out


def _op(name: str) -> Any:
    """torch.ops.aten.<op>.<overload> for a registration name "aten::op[.overload]"."""
    import torch

    base, _, overload = name.removeprefix("aten::").partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


# ---- scaled_dot_product_attention -------------------------------------------------------------------------


# ---- dropout, DeepSpeed's linear, CPU GEMM scratch ----------------------------------------------------------


def grouped_mm():  # noqa: ANN201
    """transformers' _grouped_mm (integrations/moe.py) as the job runs it: torch's grouped_mm for every dtype on a
    GPU, whose autograd node (tools/autograd/derivatives.yaml _grouped_mm: self from grad and mat2, mat2 from self
    and grad) saves the input only where the weight needs a gradient and the weight only where the input does, and
    makes only the gradients needed: frozen experts (LoRA) keep nothing of their input. The fake kernels take bf16
    only (torch/_meta_registrations.py _meta_grouped_mm_common), so other dtypes compute through transformers'
    fallback op, whose own autograd would save both and make both gradients."""
    import torch

    ops = torch.ops.transformers

    class GroupedMm(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, w: Any, offs: Any) -> Any:
            ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w if ctx.needs_input_grad[0] else None)
            ctx.offs = offs
            return ops.grouped_mm_fallback(x, w, offs)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            x, w = ctx.saved_tensors
            if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
                gx, gw = ops.grouped_mm_fallback_backward(x, w, ctx.offs, grad)
                return gx, gw, None
            if ctx.needs_input_grad[0]:
                return ops.grouped_mm_fallback(grad, w.transpose(-2, -1), ctx.offs), None, None
            return None, x.new_empty((ctx.offs.shape[0], x.shape[1], grad.shape[1])), None

    def run(input: Any, weight: Any, offs: Any) -> Any:
        return GroupedMm.apply(input.to(weight.dtype), weight, offs)

    return run


@contextlib.contextmanager
def balanced_topk_gating(config: dict[str, Any]) -> Iterator[None]:
    """JetMoE's router (transformers 5.25 models/jetmoe/modeling_jetmoe.py JetMoeTopKGating, for its MoE and its
    mixture-of-attention experts) reads each expert's token count back (``expert_size.tolist()``), which a fake
    tensor does not have (DataDependentOutputException), and each expert's linear then takes that many rows
    (``inputs.split(expert_size)``). In the trace the counts are balanced: the tokens x top_k rows spread evenly
    over the experts (the first ones one more where they do not divide), the load a balanced router gives; every
    tensor the router makes is made as it makes it, and the experts' inputs and outputs hold the same rows in
    all. Nothing for other configs."""
    if config.get("model_type") != "jetmoe":
        yield
        return
    import torch
    from transformers.models.jetmoe import modeling_jetmoe as jm

    real = jm.JetMoeTopKGating.forward

    def forward(self: Any, hidden_states: Any) -> Any:
        logits = self.layer(hidden_states).float()
        top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
        top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
        zeros = torch.zeros([top_k_gates.size(0), self.num_experts], dtype=top_k_gates.dtype,
                            device=top_k_gates.device)
        gates = zeros.scatter(1, top_k_indices, 1)
        gates.long().sum(0)  # the counts, made and dropped as the router makes them
        rows, experts = top_k_gates.size(0) * self.top_k, self.num_experts
        expert_size = [rows // experts + (i < rows % experts) for i in range(experts)]
        top_k_experts = top_k_indices.flatten()
        _, index_sorted_experts = top_k_experts.sort(0)
        batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
        top_k_gates = top_k_gates.flatten()
        batch_gates = top_k_gates[index_sorted_experts]
        return index_sorted_experts, batch_index, batch_gates, expert_size, logits

    jm.JetMoeTopKGating.forward = forward
    try:
        yield
    finally:
        jm.JetMoeTopKGating.forward = real


def cuda_dropout(compiled: bool = False):  # noqa: ANN201
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
        if compiled:  # CUDA's own op, which a compiled graph decomposes (tracing/compiled.py)
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return BoolMaskDropout.apply(input)

    return dropout


def deepspeed_zero3_linear(device: str) -> Any:
    """torch.nn.functional.linear as DeepSpeed ZeRO-3 replaces it (deepspeed/runtime/zero/linear.py,
    LinearFunctionForZeroStage3, 0.19.8; installed by partition_parameters.py _enable_mem_efficient_linear when
    zero_optimization.memory_efficient_linear is on, its default, including for a materialised model, which
    DeepSpeedZeRoOffload converts through zero.Init). What differs from aten's linear, op for op:
    - it saves its inputs as given (setup_context), so under autocast the fp32 input and weight, not
      autocast's bf16 copies (the matmul inside still casts them, as temporaries);
    - backward runs under the forward's autocast state and makes the input's gradient first, then the
      weight's (aten's MmBackward0 the reverse), so on CPU the weight GEMM's fp32 scratch coexists with the
      input's gradient.
    The backward's all_gather of a released weight is ZeRO's business (the gathered bytes), not the trace's."""
    import torch

    class LinearFunctionForZeroStage3(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input, weight, bias=None):  # noqa: ANN001, A002
            ctx.autocast = torch.is_autocast_enabled(device)
            ctx.autocast_dtype = torch.get_autocast_dtype(device)
            ctx.save_for_backward(input, weight, bias)
            if input.dim() == 2 and bias is not None:
                return torch.addmm(bias, input, weight.t())
            output = input.matmul(weight.t())
            if bias is not None:
                output += bias
            return output

        @staticmethod
        def backward(ctx, grad_output):  # noqa: ANN001
            with torch.autocast(device_type=device, enabled=ctx.autocast, dtype=ctx.autocast_dtype):
                input, weight, bias = ctx.saved_tensors  # noqa: A001
                grad_input = grad_weight = grad_bias = None
                dim = grad_output.dim()
                if ctx.needs_input_grad[0]:
                    grad_input = grad_output.matmul(weight)
                if ctx.needs_input_grad[1]:
                    if dim > 2:
                        grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
                            input.reshape(-1, input.shape[-1]))
                    elif dim == 1:
                        grad_weight = grad_output.unsqueeze(-1) * input.unsqueeze(0)
                    else:
                        grad_weight = grad_output.t().matmul(input)
                if bias is not None and ctx.needs_input_grad[2]:
                    if dim > 2:
                        grad_bias = grad_output.sum([i for i in range(dim - 1)])
                    elif dim == 1:
                        grad_bias = grad_output
                    else:
                        grad_bias = grad_output.sum(0)
                return grad_input, grad_weight, grad_bias

    def linear(input, weight, bias=None):  # noqa: ANN001, A002
        return LinearFunctionForZeroStage3.apply(input, weight, bias)

    return linear


#: the instruction sets whose bf16 GEMMs take oneDNN scratch above its size threshold (kernels.cpu_gemm_scratch)
BF16_SCRATCH_ISAS = ("avx512", "amx", "avx512_bf16")


def gemm_scratch(isa: str, threads: int = 1):  # noqa: ANN201
    """scratch(func, args, out) -> the bytes a CPU matmul allocates for itself and frees before returning, for
    ``isa`` (memplan.activations.kernels.cpu_gemm_scratch): aten::mm and aten::addmm, every nn.Linear forward and backward;
    a float8 torch._scaled_mm's emulation (kernels.cpu_scaled_mm_scratch)."""
    import torch

    aten = torch.ops.aten
    gemms = {aten.mm.default: 0, aten.addmm.default: 1}
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

    def scratch(func: Any, args: tuple, out: Any) -> int | None:
        """The bytes, 0 for a bf16 GEMM too small to take any (oneDNN's m*n*k threshold: its point is still
        kept, so that a trace at another micro-batch, where the same GEMM crosses it, runs the same points), None
        for an op that never takes scratch."""
        if func is aten._scaled_mm.default and isa != "amx":  # float8 (torchao's Float8Linear)
            a, b = args[0], args[1]
            return K.cpu_scaled_mm_scratch(a.shape[0], b.shape[1], a.shape[1], not a.is_contiguous(),
                                           not b.is_contiguous(), out.element_size())
        i = gemms.get(func)
        if i is None or not isinstance(out, torch.Tensor) or out.dim() != 2:
            return None
        m, n = out.shape
        k = args[i].shape[1]
        extra = K.cpu_gemm_scratch(isa, m, n, k, names.get(out.dtype, "other"), threads)
        return extra if extra or (out.dtype is torch.bfloat16 and isa in BF16_SCRATCH_ISAS) else None

    return scratch


# ---- CUDA reductions' staging buffers -------------------------------------------------------------------------


def cuda_scratch(gpu: tuple[int, int, int]):  # noqa: ANN201
    """transients(func, args, kwargs, out) -> what a CUDA kernel allocates for itself after its output and frees
    before returning, in allocation order, as (kind, integer arguments) for memplan.activations.kernels.kernel_scratch (sizes
    that are not lines in the micro-batch: the trace keeps their arguments, the replay evaluates them). A reduction's staging buffer and semaphores
    (memplan.activations.kernels.reduce_scratch): sum, mean, prod, nansum,
    the vector norm, amax/amin, var/std and argmax/argmin, on ``gpu`` (multiprocessors, threads per
    multiprocessor, warp size). The accumulator's size is the reduction's arg_t: float for 16- and 32-bit
    floats (double for double), the input's own type for amax/amin, Welford's (mean, m2, n, nf) for var/std
    (ReduceMomentKernel.cu), (value, int64 index) for argmax/argmin. An embedding's backward over more than
    3,072 indices (memplan.activations.kernels.embedding_backward_scratch)."""
    import torch

    aten = torch.ops.aten
    acc = {aten.sum.default: "acc", aten.sum.dim_IntList: "acc", aten.mean.default: "acc", aten.mean.dim: "acc",
           aten.prod.default: "acc", aten.prod.dim_int: "acc", aten.nansum.default: "acc",
           aten.linalg_vector_norm.default: "acc", aten.amax.default: "self", aten.amin.default: "self",
           aten.var.correction: 16, aten.std.correction: 16, aten.var_mean.correction: 16,
           aten.std_mean.correction: 16, aten.argmax.default: 16, aten.argmin.default: 16}
    dim_at = {aten.linalg_vector_norm.default: 2}

    def transients(func: Any, args: tuple, kwargs: dict, out: Any) -> list[tuple[str, list[int]]]:
        if func is aten.embedding_dense_backward.default:
            grad, indices, num_weights = args[0], args[1], args[2]
            scale = args[4] if len(args) > 4 else kwargs.get("scale_grad_by_freq", False)
            return [("embedding", [indices.numel(), num_weights, grad.shape[-1],
                                   8 if grad.dtype == torch.float64 else 4, int(bool(scale))])]
        kind = acc.get(func)
        if kind is None or not args or not isinstance(args[0], torch.Tensor):
            return []
        x = args[0]
        i = dim_at.get(func, 1)
        dims = kwargs.get("dim", args[i] if len(args) > i else None)
        if isinstance(dims, int):
            dims = (dims,)
        first = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(first, torch.Tensor):
            return []
        if kind == "acc":
            size = 8 if (x.dtype == torch.float64 or not x.dtype.is_floating_point) else 4
        elif kind == "self":
            size = x.element_size()
        else:
            size = kind
        spec = K.scratch_args(tuple(x.shape), tuple(x.stride()), tuple(dims) if dims else None,
                              x.element_size(), size, first.element_size(), gpu)
        return [("reduce", spec), ("semaphores", spec)]

    return transients


# ---- expert parallelism: transformers' AllToAllEP with the collectives taken out ---------------------------------


def expert_parallel(model: Any, ep: int, tp: int = 1) -> int:
    """The model as one EP rank runs it (transformers/distributed/expert_parallel.py, transformers 5.23): each
    MoE layer's fused expert weights cut to this rank's E / ep experts (MoEParamShard, Shard(0)) and its experts
    module reached through AllToAllEP's dispatch and combine, with each all-to-all a copy of what it sends: the
    rank receives as many (token, expert) rows as it sends, tokens x top_k, the balanced routing a load-balanced
    router aims at. What AllToAllEP allocates and saves is kept: the sorted send rows (an index whose backward
    keeps the order), the received rows (a new buffer, the functional all-to-all's output), the experts run top-1
    with unit weights, the combined rows scattered back into token order (index_put, the order kept) and weighted
    (the weighted product keeps the rows and the weights). With TP (``tp`` ranks sharing a batch) each takes its
    1/tp of the tokens first (Replicate -> Shard(0): a chunk) and the combined outputs are all-gathered back over
    the TP ranks (Shard(0) -> Replicate: a new [tokens, hidden] buffer). Returns the experts modules changed."""
    import torch

    class _AllToAll(torch.autograd.Function):
        """all_to_all_single_autograd: a new output buffer; its backward is the reverse all-to-all (another new
        buffer) and saves nothing."""

        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g.clone()

    changed = 0
    for name, mod in model.named_modules():
        if not name.endswith(".experts"):
            continue
        gate_up = getattr(mod, "gate_up_proj", None)
        if gate_up is None or gate_up.dim() != 3:
            continue
        experts = gate_up.shape[0]
        local = experts // ep
        for pname in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            p = getattr(mod, pname, None)
            if p is not None:
                setattr(mod, pname, torch.nn.Parameter(p.detach()[:local].clone(), requires_grad=p.requires_grad))
        mod.num_experts = local
        forward = mod.forward

        def ep_forward(hidden_states: Any, top_k_index: Any, top_k_weights: Any, forward: Any = forward,
                       local: int = local) -> Any:
            whole = hidden_states.shape[0]
            if tp > 1:  # this TP rank's slice of the batch the TP group shares
                rows_tp = -(-whole // tp)
                hidden_states, top_k_index, top_k_weights = (t[:rows_tp] for t in (hidden_states, top_k_index,
                                                                                    top_k_weights))
            num_tokens, num_top_k = top_k_index.shape
            order = torch.argsort(top_k_index.reshape(-1))
            send = hidden_states[order // num_top_k]
            recv = _AllToAll.apply(send)
            ids = torch.zeros(recv.shape[0], 1, dtype=torch.long, device=recv.device)
            weights = torch.ones(recv.shape[0], 1, dtype=recv.dtype, device=recv.device)
            out = forward(recv, ids, weights)
            back = _AllToAll.apply(out)
            rows = torch.empty_like(back)
            rows[order] = back
            rows = rows.view(num_tokens, num_top_k, out.shape[-1])
            output = (rows * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)
            if tp > 1:  # all-gathered back over the TP ranks
                output = torch.cat([output] * tp)[:whole]
            return output

        mod.forward = ep_forward
        mod.memplan_expert_parallel = True  # its own FSDP2 unit: tracing/step.py marks where it runs
        changed += 1
    return changed
