"""The live bytes of a traced step, op by op: every storage the step creates, until it dies."""

from __future__ import annotations

import weakref
from typing import Any


class LiveBytes:
    """Live bytes of the storages created under the mode, op by op.

    Parameter gradients are not activations: when a storage turns out to be a parameter's .grad (seen in the
    post-accumulate hook), its bytes are taken out of the timeline from its creation on.
    """

    def __init__(self, block: int = 1) -> None:
        #: the allocator's granularity: a storage of n bytes holds round_up(n, block) (CUDA: 512)
        self.block = block
        self.live = 0
        self._refs: dict[int, Any] = {}
        self._born: dict[int, int] = {}
        self.timeline: list[int] = [0]
        #: storages alive at each timeline point (memplan/activations/profile_fit.py bounds the allocator's rounding with it)
        self.count = 0
        self.counts: list[int] = [0]
        self._corrections: list[tuple[int, int, int]] = []  # (from index, to index, bytes)
        #: the step as the caching allocator sees it: a birth is [bytes] (the storage's id is the number of births
        #: before it), a death the dead storage's id; mark_grad appends the block to a gradient's birth
        self.events: list[Any] = []
        self._births_list: list[list[int]] = []
        self._sid: dict[int, int] = {}
        #: where each storage came from (--explain; memplan/activations/tracing/explain.py): ``labeler()`` names the module
        #: running, ``op`` the operator that made it; per storage id: (module, op, dtype, shape, born, died)
        self.labeler: Any = None
        self.op = ""
        self.origins: list[list[Any]] = []
        self.grad_ids: set[int] = set()
        #: gradient storage ids in the order they were ready (mark_grad)
        self.ready: list[int] = []
        #: births before the first cuBLAS call's outputs are tracked and counted, in forward ("f") and after it
        #: ("b"): where the forward thread's and autograd's thread's cuBLAS workspaces are allocated (BLAS_OPS)
        self.blas: dict[str, int] = {}
        self.phase = "f"

    def alias(self, t: Any) -> None:
        """``t``'s storage holds no bytes of its own (a view made on a copy: dispatch_mode's _view_base): it and the
        views made of it are never counted."""
        st = t.untyped_storage()
        key = id(st)
        if key not in self._refs:
            self._refs[key] = weakref.ref(st, lambda _ref, key=key: self._refs.pop(key, None))

    def track(self, t: Any) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self._refs:
            return
        n = self.nbytes(st)
        sid = len(self._births_list)
        self._sid[key] = sid
        self._births_list.append([n])
        self.events.append(self._births_list[-1])
        if self.labeler is not None:
            self.origins.append([self.labeler(), self.op, str(t.dtype).removeprefix("torch."), list(t.shape),
                                 len(self.timeline), None, n])

        def gone(_ref: Any, key: int = key, n: int = n, sid: int = sid) -> None:
            self._refs.pop(key, None)
            self._born.pop(key, None)
            self._sid.pop(key, None)
            self.events.append(sid)
            self.live -= n
            self.count -= 1
            if sid < len(self.origins):
                self.origins[sid][5] = len(self.timeline)

        self._refs[key] = weakref.ref(st, gone)
        self._born[key] = len(self.timeline)
        self.live += n
        self.count += 1

    def nbytes(self, st: Any) -> int:
        """What the allocator counts for an untyped storage."""
        n = st.nbytes()
        return -(-n // self.block) * self.block

    def ignore(self, t: Any) -> None:
        """A storage that existed before the step (parameters, buffers): views of it are not new bytes."""
        self._refs[id(t.untyped_storage())] = None

    def transient(self, scratch: list[tuple[str, list[int]]]) -> None:
        """Storages a kernel allocates for itself, in this order, and frees in the reverse order before it returns
        (a CUDA reduction's staging buffer and semaphores): births [bytes, "k", kind, arguments] and their deaths
        in the events, for the caching allocator's replay, which sizes them at its own micro-batch
        (kernels.kernel_scratch). They are left out of the timeline, whose points are lines in the micro-batch."""
        from memplan.activations.kernels import kernel_scratch

        sids = []
        for kind, args in scratch:
            sids.append(len(self._births_list))
            self._births_list.append([kernel_scratch(kind, tuple(args)), "k", kind, list(args)])
            self.events.append(self._births_list[-1])
            if self.labeler is not None:
                self.origins.append([self.labeler(), self.op, "uint8", [], len(self.timeline), len(self.timeline), 0])
        self.events.extend(reversed(sids))

    def tick(self) -> None:
        self.timeline.append(self.live)
        self.counts.append(self.count)

    def not_activation(self, t: Any) -> int | None:
        """``t`` is a parameter gradient: remove it from the timeline since it was created; returns the timeline
        index at which it was created (None if it was not created under the mode)."""
        st = t.untyped_storage()
        born = self._born.get(id(st))
        if id(st) in self._sid:
            self.grad_ids.add(self._sid[id(st)])
        if born is not None:
            self._corrections.append((born, len(self.timeline) + 1, self.nbytes(st)))
            self._born.pop(id(st), None)
        return born

    def mark_grad(self, t: Any, block: int) -> None:
        """``t`` is the gradient of a parameter of ``block`` (-1: outside the blocks): its birth says so. Called
        when the gradient is ready (its post-accumulate hook), so the calls' order is the order DDP's Reducer
        sees (ready_order). A first contribution that became the gradient (added into in place) is a gradient."""
        sid = self._sid.get(id(t.untyped_storage()))
        if sid is not None and (len(self._births_list[sid]) == 1 or self._births_list[sid][1:] == CONTRIBUTION):
            del self._births_list[sid][1:]
            self._births_list[sid].append(block)
            self.ready.append(sid)

    def mark_contribution(self, t: Any) -> None:
        """``t`` is the first gradient contribution to a parameter the graph reaches more than once (a tied
        weight's, from the head's matmul): its birth says so ([bytes, None, -1]: no parameter's gradient yet, and
        a weight gradient's matmul output all the same, which replay.zero3_linear_order orders as one)."""
        sid = self._sid.get(id(t.untyped_storage()))
        if sid is not None and len(self._births_list[sid]) == 1:
            self._births_list[sid].extend(CONTRIBUTION)

    def ready_order(self) -> None:
        """Each gradient's birth gets a third item: how many gradients born after it were ready before it (a
        Linear's bias, summed after its weight's matmul, reaches its AccumulateGrad first: autograd runs
        AccumulateGrad nodes before any other ready node). The replay rebuilds the ready order from it
        (replay.ready_order), wherever the step is repeated to the model's depth."""
        for i, sid in enumerate(self.ready):
            late = sum(1 for other in self.ready[:i] if other > sid)
            if len(self._births_list[sid]) == 2:
                self._births_list[sid].append(late)

    def not_activation_between(self, start: int, end: int, nbytes: int) -> None:
        """Bytes that were a gradient, not an activation, from timeline index ``start`` to ``end``."""
        self._corrections.append((start, end, nbytes))

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


#: what a first gradient contribution's birth carries after its bytes (LiveBytes.mark_contribution): no
#: parameter's block, and "late" -1
CONTRIBUTION = [None, -1]


#: the ATen operators a CUDA build runs through cuBLAS(Lt) (aten/src/ATen/native/cuda/Blas.cpp): the first one a
#: thread calls creates that thread's handle and its workspace (at::cuda::getCurrentCUDABlasHandle ->
#: getCUDABlasLtWorkspace / cublasSetWorkspace, allocated by the caching allocator), after the op's output
BLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "addr",
                      "_addmm_activation", "_scaled_mm", "_int_mm"})


def plain_tensors(t: Any) -> list[Any]:
    """The plain tensors holding a tensor's bytes: itself, or a tensor subclass's inner tensors
    (__tensor_flatten__: torchao's Float8TrainingTensor holds its float8 data and its scale)."""
    if not hasattr(type(t), "__tensor_flatten__"):
        return [t]
    return [x for n in t.__tensor_flatten__()[0] for x in plain_tensors(getattr(t, n))]


def _quiet(func: Any, out: Any) -> bool:
    """An operator that allocates nothing and writes nothing: a view (every output aliases an input, none written:
    slice, unbind, view) or one that returns no tensor (prim.device). It is no point of the timeline: a step whose
    views follow the batch (LLaVA's image features unbound per image) keeps the same points at every micro-batch,
    and a free before it shows at the next operator's point (lower than the one before it, so no peak is lost)."""
    import torch

    returns = func._schema.returns
    if not any(isinstance(t, torch.Tensor) for t in (out if isinstance(out, (list, tuple)) else (out,))):
        return not returns or all(str(r.type) not in ("Tensor", "Tensor[]", "Tensor?") for r in returns)
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


#: ATen operators whose kernels copy the inputs at these positions to contiguous tensors first, kept to the kernel's
#: end, on the CPU and on CUDA alike: softmax and log_softmax (aten/src/ATen/native/SoftMax.cpp softmax_cpu_out,
#: _log_softmax_cpu_out: ``input.contiguous()``; cuda/SoftMax.cu host_softmax: ``input_.contiguous()``) and their
#: backwards (softmax_backward_cpu_out; cuda host_softmax_backward: ``grad_.contiguous()``,
#: ``output_.contiguous()``). A non-contiguous input (Longformer's chunked scores) is so copied whole, beside the
#: output. Measured: LED, bf16 autocast, its 33,587,200-byte scores copied at the forward's peak (-3.94% without).
CONTIGUOUS_INPUTS = {"_softmax.default": (0,), "_log_softmax.default": (0,),
                     "_softmax_backward_data.default": (0, 1), "_log_softmax_backward_data.default": (0, 1)}


#: operators whose schema says their output may alias the input but which copy when they must (contiguous of a
#: strided tensor): never taken for views here
MAY_COPY = frozenset({"contiguous", "reshape", "to"})


def _view_base(func: Any, args: tuple, outs: list[Any]) -> Any:
    """The input a view operator's outputs alias where they do not share its storage, else None: a fake mode's
    constant fast path computes an operator of value-carrying fake tensors on their values and wraps the result
    afresh, views included (FakeTensor.constant)."""
    import torch

    returns = func._schema.returns
    if not outs or not returns or not all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return None
    base = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if base is None or hasattr(type(base), "__tensor_flatten__") or getattr(base, "constant", None) is None \
            or func.__name__.split(".")[0] in MAY_COPY:
        return None
    st = base.untyped_storage()._cdata
    if any(t.untyped_storage()._cdata == st for t in outs):
        return None
    return base


def dispatch_mode(live: LiveBytes, scratch: Any = None, transients: Any = None, accumulate: Any = None) -> Any:
    """Follows every storage created under it; ``scratch(func, args, out)`` adds an op's own temporary bytes
    (allocated and freed inside the kernel) as one extra point of the timeline after the op;
    ``transients(func, args, kwargs, out)`` the storages a kernel allocates and frees after its output, as
    allocator events too (LiveBytes.transient); ``accumulate`` (tracing/accumulate.py) redoes in place the
    autograd engine's gradient accumulations that a real run does in place."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    aten = torch.ops.aten
    contiguous = {getattr(getattr(aten, k.split(".")[0]), k.split(".")[1]): v for k, v in CONTIGUOUS_INPUTS.items()}

    class Mode(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            """dynamo runs beside this mode (a compiled region's graphs run under it, its compilation does not:
            tracing/compiled.py)."""
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            wrapper = next((t for t in types if hasattr(t, "__tensor_flatten__")), None)
            if wrapper is not None:
                # a tensor subclass's operator (torchao's Float8TrainingTensor): the mode comes first, so the
                # subclass's own __torch_dispatch__ is run under it here, and the plain tensors its implementation
                # allocates (torchao's float8_ops.py: a transposed copy for _scaled_mm) are followed like any other;
                # the wrapper it returns holds no storage of its own
                with self:
                    return wrapper.__torch_dispatch__(func, types, args, kwargs or {})
            copied = contiguous.get(func)
            if copied and any(isinstance(args[i], torch.Tensor) and not args[i].is_contiguous() for i in copied):
                # the kernel's own contiguous copies (CONTIGUOUS_INPUTS), made first here, freed on return
                args = tuple(self.__torch_dispatch__(aten.clone.default, types, (a,),
                                                     {"memory_format": torch.contiguous_format})
                             if i in copied and isinstance(a, torch.Tensor) and not a.is_contiguous() else a
                             for i, a in enumerate(args))
            out = accumulate.maybe_inplace(func, args, kwargs or {}, live) if accumulate is not None else None
            if out is None:
                out = func(*args, **(kwargs or {}))
            live.op = getattr(func, "_opname", None) or str(func)
            leaves = [t for t in tree_leaves(out)
                      if isinstance(t, torch.Tensor) and not hasattr(type(t), "__tensor_flatten__")]
            base = _view_base(func, args, leaves)
            for t in leaves:
                if base is not None:
                    # a view the fake mode made on a storage of its own (its constant fast path computes an op of
                    # constants on their values and wraps the result afresh: a Longformer mask's [:, 0, 0, :]): it
                    # holds no bytes, and keeps its base alive as the model's view keeps its base's storage
                    t._memplan_base = base  # type: ignore[attr-defined]
                    live.alias(t)
                    continue
                live.track(t)
            if live.phase not in live.blas and live.op.split(".")[0] in BLAS_OPS:
                live.blas[live.phase] = len(live._births_list)
            if transients is not None:
                own = transients(func, args, kwargs or {}, out)
                if own:
                    live.transient(own)
            if scratch is not None:
                extra = scratch(func, args, out)
                if extra is not None:
                    live.live += extra
                    live.tick()
                    live.live -= extra
            if not _quiet(func, out):
                live.tick()
            return out

    mode = Mode()
    mode.live = live  # type: ignore[attr-defined]  # tracing/compiled.py: a compiled graph's in-place writes
    return mode
