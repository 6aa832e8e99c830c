"""torch.compile in the traced step: what the compiled graphs save for backward and what their kernels allocate.

A compiled region runs as one autograd function whose forward graph returns what its backward needs. What that
is, is decided by AOTAutograd's partitioner on the joint forward+backward graph. Inductor's own pipeline is
followed up to the generated code (torch/_inductor/compile_fx.py, torch 2.13):

* dynamo captures the region (``torch.compile(..., backend=...)``, the backend being ``compile_fx`` itself);
* ``compile_fx`` lowers it with inductor's decomposition table and runs its joint-graph passes and
  ``min_cut_rematerialization_partition(compiler="inductor")`` (compile_fx.py ``partition_fn``), so the saved
  tensors are the ones inductor saves;
* instead of ``compile_fx_inner`` (code generation) the forward and backward graphs run here op by op, on the
  trace's fake tensors, under the trace's instruments (:class:`Graph`).

What inductor's generated code allocates inside a graph is modelled from its lowering rules
(torch/_inductor/lowering.py, scheduler.py, wrapper codegen):

* pointwise operators, views, index/gather reads and reductions fuse into the kernel that consumes them (a
  reduction with its pointwise epilogue over the same rows: RMSNorm's statistics never reach memory): no buffer
  of their own;
* a buffer is made for a graph output (a saved tensor, the region's result), for an input of an extern kernel
  (matmuls, attention, convolution, scatters: ``ExternKernel``/``FallbackKernel``, which read realized buffers)
  and for an extern kernel's own output;
* a buffer lives from its kernel until the last kernel that reads it (through fused operators too), and is
  freed then (the wrapper's ``del``); a graph input of the backward (saved tensors, handed over with the boxed
  calling convention) is freed after its last read likewise;
* a pointwise kernel whose output has the size of a buffer that dies in it writes in place
  (``inplace_buffers``/``can_inplace``): no new bytes.

Inductor's other heuristics (realizing a pointwise node read by many kernels, reordering kernels for peak
memory, ``post_grad`` passes) are not modelled: within a graph the figure holds what the rules above hold.

The mode modelled is ``blocks``: each transformer block's forward compiled (torchtitan's per-block compile,
torchtitan/models/llama3/infra/parallelize.py ``apply_compile``; the trace's block moments stay outside). The whole
model in one graph (``torch.compile(model)``, the HF Trainer's ``torch_compile``) is not: its single backward
graph holds what separately compiled regions do not (a trace of the model as separately compiled regions came
out under the CPU harness's whole-model runs), and the trace's per-block moments would be inside it.

The trace's dispatch mode (tracing/live.py) says ``ignore_compile_internals``: dynamo compiles beside it
without it seeing the compilation, and the compiled graphs run under it. The fused attention stand-in is one
operator inside the graphs (substitutes_sdpa.compiled_ops), its scratch allocated after it as the kernel's own.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Iterator
from typing import Any

from memplan.activations.tracing_keys import COMPILE_DDP_KEY, COMPILE_KEY, COMPILE_MODES

__all__ = ["COMPILE_DDP_KEY", "COMPILE_KEY", "Graph", "compiling", "inductor_backend", "warm_up"]

#: ATen operators inductor lowers to loops that fuse (torch/_inductor/lowering.py) beyond those tagged pointwise
_FUSIBLE = frozenset({
    "embedding", "index", "gather", "index_select", "where", "clone", "_to_copy", "copy", "full", "full_like",
    "zeros", "zeros_like", "ones", "ones_like", "scalar_tensor", "iota", "arange", "cat", "constant_pad_nd",
    "slice_scatter", "select_scatter", "masked_fill", "fill", "lift_fresh_copy", "expand_copy", "permute_copy",
    "_unsafe_view", "view_copy", "convert_element_type", "rand", "rand_like", "randn", "randn_like",
    "bernoulli", "native_dropout", "tril", "triu", "repeat", "flip", "roll", "squeeze_copy", "unsqueeze_copy",
})
#: reductions: their input fuses into them, and they into the pointwise kernel that reads their result
_REDUCTIONS = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "std", "any", "all", "argmax",
    "argmin", "logsumexp", "_softmax", "_log_softmax", "norm", "linalg_vector_norm",
})


def _name(target: Any) -> str:
    name = getattr(target, "__name__", "") or ""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        name = schema.name.split("::")[-1]
    return name.split(".")[0]


def _kind(node: Any) -> str:
    """'view' (no buffer), 'fused' (a pointwise/indexing op fused into its consumer), 'reduction' (fused too,
    its input into it), 'extern' (a kernel of its own, reading buffers) or 'other' (placeholders, the output)."""
    import torch

    if node.op != "call_function":
        return "other"
    t = node.target
    if t is operator.getitem:
        return "view"
    if isinstance(t, torch._ops.OpOverload):
        if t.is_view:
            return "view"
        name = _name(t)
        if name in _REDUCTIONS:
            return "reduction"
        if torch.Tag.pointwise in t.tags or name in _FUSIBLE:
            return "fused"
        return "extern"
    name = _name(t)
    if name in _REDUCTIONS:
        return "reduction"
    if name in _FUSIBLE or str(getattr(t, "__module__", "")).startswith("torch._prims"):
        return "fused"
    return "extern"


class Graph:
    """One compiled graph run op by op as inductor's code runs it (the module docstring's rules)."""

    def __init__(self, gm: Any) -> None:
        nodes = list(gm.graph.nodes)
        self.gm = gm
        self.nodes = nodes
        self.index = {n: i for i, n in enumerate(nodes)}
        out = next(n for n in nodes if n.op == "output")
        outputs = {a for a in out.all_input_nodes}
        kind = {n: _kind(n) for n in nodes}
        # a node must be a buffer when a graph output, an extern kernel or a view passed on to one reads it
        need: dict[Any, bool] = {}
        for n in reversed(nodes):
            need[n] = n in outputs or any(
                kind[u] in ("extern", "other") or (kind[u] == "view" and need.get(u, False)) for u in n.users)
        self.buffer = {n: kind[n] == "extern" or (kind[n] in ("fused", "reduction") and need[n]) for n in nodes}
        self.kind = kind
        # the last kernel that reads each value: through fused operators and views to the buffer they end in
        last: dict[Any, int] = {}
        end = len(nodes)
        for n in reversed(nodes):
            at = -1
            for u in n.users:
                if u.op == "output":
                    at = end
                elif self.buffer[u] or kind[u] == "other":
                    at = max(at, self.index[u])
                else:
                    at = max(at, last.get(u, self.index[u]))
            last[n] = at if at >= 0 else self.index[n]
        self.last = last
        self.frees: dict[int, list[Any]] = {}
        for n, i in last.items():
            if n.op != "output" and i < end:
                self.frees.setdefault(i, []).append(n)
        # the buffers each kernel reads (through fused operators and views): in-place candidates
        self.reads: dict[Any, set[Any]] = {}
        for n in nodes:
            got: set[Any] = set()
            for a in n.all_input_nodes:
                if a.op == "placeholder" or self.buffer[a]:
                    got.add(a)
                else:
                    got |= self.reads.get(a, set())
            self.reads[n] = got

    def run(self, args: list[Any]) -> Any:
        from torch.fx.node import map_arg

        from memplan.activations.substitutes_sdpa import compiled_ops

        after = compiled_ops()["after"]
        live = _live()
        env: dict[Any, Any] = {}
        # boxed: the graph owns its inputs (the backward's saved tensors) and frees each at its last use
        inputs = list(reversed(args))
        args.clear()
        result = None
        for i, n in enumerate(self.nodes):
            if n.op == "placeholder":
                env[n] = inputs.pop()
            elif n.op == "output":
                result = map_arg(n.args[0], lambda a: env[a])
            elif n.op == "get_attr":
                env[n] = getattr(self.gm, n.target)
            else:
                a = map_arg(n.args, lambda x: env[x])
                k = map_arg(n.kwargs, lambda x: env[x])
                if self.buffer[n] or self.kind[n] == "other":
                    dying = None
                    if self.kind[n] == "fused" and live is not None:
                        dying = self._inplace(n, env)
                    if dying is not None:
                        # written into a buffer that dies in this kernel: computed apart, then takes its place
                        with _lifted():
                            env[n] = n.target(*a, **k)
                        del a, k
                        env.pop(dying, None)
                        self._free_at(i, env, skip=dying)
                        for t in _tensors(env[n]):
                            live.track(t)
                        live.tick()
                        continue
                    env[n] = n.target(*a, **k)
                    if n.target in after:  # the kernel's own scratch, after its outputs
                        after[n.target](a, env[n])
                else:
                    # fused into the kernel that reads it, or a view (of a buffer, counted already, or of a fused
                    # value, which has none): no new bytes
                    with _lifted():
                        env[n] = n.target(*a, **k)
                del a, k
            self._free_at(i, env)
        env.clear()
        return result

    def _free_at(self, i: int, env: dict[Any, Any], skip: Any = None) -> None:
        for dead in self.frees.get(i, ()):
            if dead is not skip:
                env.pop(dead, None)

    def _inplace(self, n: Any, env: dict[Any, Any]) -> Any:
        """A buffer read by kernel ``n`` that dies in it and has its output's size (inductor writes in place), or
        None. Graph inputs are not reused (the forward's belong to the caller)."""
        import torch

        meta = n.meta.get("val")
        if not isinstance(meta, torch.Tensor):
            return None
        size = meta.numel() * meta.element_size()
        for r in sorted(self.reads[n], key=lambda x: self.index[x]):
            if r.op == "placeholder" or self.last.get(r) != self.index[n] or r not in env:
                continue
            v = env[r]
            if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes() == size and v.dtype == meta.dtype \
                    and sum(1 for x in env.values() if x is v) == 1:
                return r
        return None


def _tensors(x: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _user_modes() -> list[Any]:
    """The dispatch modes on the stack that are not infrastructure (FakeTensorMode is), bottom first."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return [m for m in _get_current_dispatch_mode_stack() if not m.is_infra_mode()]


def _live() -> Any:
    """The trace's LiveBytes, from its dispatch mode on the stack (tracing/live.py), or None."""
    for m in _user_modes():
        live = getattr(m, "live", None)
        if live is not None:
            return live
    return None


@contextlib.contextmanager
def _lifted() -> Iterator[None]:
    """The user dispatch modes taken off while a fused operator runs: its value is computed, no buffer made."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    modes = _user_modes()
    for _ in modes:
        _pop_mode()
    try:
        yield
    finally:
        for m in modes:
            _push_mode(m)


def _inner(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
    """compile_fx's inner compiler: the graph run by :class:`Graph` (boxed calling convention)."""
    g = Graph(gm)
    _GRAPHS[0] += 1

    def run(args: list[Any]) -> Any:
        return g.run(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


#: graphs compiled since the last torch._dynamo.reset(), and by the end of the warm-up step (compiling() checks
#: that the regions made some, and that the traced step made none)
_GRAPHS = [0, 0]


def inductor_backend(gm: Any, example_inputs: Any) -> Any:
    """A torch.compile backend: inductor's compile_fx up to its partitioner, the graphs then run by :class:`Graph`
    (bench/compile_rules.py compiles with it on real tensors, against inductor itself)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, inner_compile=_inner)


def warm_up(model: Any, run: Any, params: list[Any], autocast: bool) -> None:
    """One step of the compiled model, untracked, before the traced one: dynamo's compilation keeps references to
    the inputs of the step it compiles in (its variable trackers hold them until torch._dynamo.reset()), which a
    job's later steps do not see; and the traced step then runs what is compiled, compiling nothing (checked on
    leaving ``compiling``)."""
    import torch

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = run(model)
    loss.backward()
    del loss
    for p in params:
        p.grad = None
    _GRAPHS[1] = _GRAPHS[0]


@contextlib.contextmanager
def compiling(blocks: list[Any], mode: str, ddp_bucket: int | None = None) -> Iterator[None]:
    """The model's blocks compiled for the step (``blocks``). Under DDP (``ddp_bucket``: the Reducer's bucket cap
    in bytes) each region is split as dynamo splits it inside DDP's forward: convert_frame.py hands the backend
    to DDPOptimizer(bucket_bytes_cap=ddp_module.bucket_bytes_cap), which cuts the graph where the parameters'
    gradients fill a bucket (the first one at DDP's 1 MiB first bucket) and compiles each piece apart."""
    import torch

    if mode not in COMPILE_MODES or mode == "none":
        yield
        return
    torch._dynamo.reset()
    _GRAPHS[:] = [0, 0]

    backend: Any = inductor_backend
    if ddp_bucket:
        from torch._dynamo.backends.distributed import DDPOptimizer

        backend = DDPOptimizer(bucket_bytes_cap=ddp_bucket, backend_compile_fn=inductor_backend).compile_fn

    for b in blocks:  # the forward compiled; the block's own hooks (the trace's moments) stay outside the graph
        b.forward = torch.compile(b.forward, backend=backend, dynamic=False)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    config = torch._dynamo.config.patch(cache_size_limit=64, automatic_dynamic_shapes=False,
                                        accumulated_cache_size_limit=512,
                                        # the attention stand-in records the kernel it chose (a dict), inside a
                                        # checkpointed block too
                                        skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    # the backward compiled with the forward, inside dynamo's compilation, which the trace's mode does not see
    # (AOTAutograd otherwise lowers it at the first backward, under the mode); nothing read from or written to
    # the on-disk caches, so each trace compiles the same way
    aot = functorch_config.patch(force_non_lazy_backward_lowering=True, enable_autograd_cache=False)
    caches = inductor_config.patch(fx_graph_cache=False)
    # compiling leaves reference cycles that hold a few of the step's tensors (a 16 KB int64 position tensor of
    # llama's, seen); Python's collector frees them whenever it happens to run, so two traces would differ: it
    # does not run during the step
    import gc

    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        with warnings.catch_warnings(), config, aot, caches:
            # the trace's own global module hooks (tracing/explain.py) stay out of compiled code (is_compiling)
            warnings.filterwarnings("ignore", message=".*global hooks on modules.*")
            yield
        if not _GRAPHS[0]:
            raise ValueError("torch.compile captured no graph of the model's blocks")
        if _GRAPHS[0] != _GRAPHS[1]:
            raise ValueError("torch.compile compiled again in the traced step (a guard failed after the warm-up step)")
    finally:
        if was:
            gc.enable()
        for b in blocks:
            b.__dict__.pop("forward", None)
        torch._dynamo.reset()
