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

Kernels: the step runs on fake CPU tensors, and where the target device (``kernels.Target``) runs something
else the trace runs a stand-in (``memplan/substitutes.py``): each SDPA call takes the backend the device's own
rules choose (``memplan/kernels.py``: CUDA's cuDNN / flash / memory-efficient / math, CPU's flash / math), a
fused backend saving and allocating what it does on the device, math running PyTorch's composite; a GPU job
runs CUDA's autocast policy (taken from the installed PyTorch's AutocastCUDA kernels), CUDA's fused dropout,
and counts every storage in the caching allocator's 512-byte blocks; a CPU job adds oneDNN's GEMM scratch for
its instruction set. The profile records which attention kernels ran and why (``attention_kernels``).
``eager`` runs transformers' eager attention as written.

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

from memplan import kernels as K
from memplan import substitutes as sub
from memplan.activations import PROFILE_VERSION
from memplan.errors import SettingsError
from memplan.kernels import Target
from memplan.tracing_keys import trace_dtypes

class _LiveBytes:
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
        self._corrections: list[tuple[int, int, int]] = []  # (from index, to index, bytes)
        #: the step as the caching allocator sees it: a birth is [bytes] (the storage's id is the number of births
        #: before it), a death the dead storage's id; mark_grad appends the block to a gradient's birth
        self.events: list[Any] = []
        self._births_list: list[list[int]] = []
        self._sid: dict[int, int] = {}

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

        def gone(_ref: Any, key: int = key, n: int = n, sid: int = sid) -> None:
            self._refs.pop(key, None)
            self._born.pop(key, None)
            self._sid.pop(key, None)
            self.events.append(sid)
            self.live -= n

        self._refs[key] = weakref.ref(st, gone)
        self._born[key] = len(self.timeline)
        self.live += n

    def nbytes(self, st: Any) -> int:
        """What the allocator counts for an untyped storage."""
        n = st.nbytes()
        return -(-n // self.block) * self.block

    def ignore(self, t: Any) -> None:
        """A storage that existed before the step (parameters, buffers): views of it are not new bytes."""
        self._refs[id(t.untyped_storage())] = None

    def tick(self) -> None:
        self.timeline.append(self.live)

    def not_activation(self, t: Any) -> int | None:
        """``t`` is a parameter gradient: remove it from the timeline since it was created; returns the timeline
        index at which it was created (None if it was not created under the mode)."""
        st = t.untyped_storage()
        born = self._born.get(id(st))
        if born is not None:
            self._corrections.append((born, len(self.timeline) + 1, self.nbytes(st)))
            self._born.pop(id(st), None)
        return born

    def mark_grad(self, t: Any, block: int) -> None:
        """``t`` is the gradient of a parameter of ``block`` (-1: outside the blocks): its birth says so."""
        sid = self._sid.get(id(t.untyped_storage()))
        if sid is not None and len(self._births_list[sid]) == 1:
            self._births_list[sid].append(block)

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


def _mode(live: _LiveBytes, scratch: Any = None) -> Any:
    """Follows every storage created under it; ``scratch(func, args, out)`` adds an op's own temporary bytes
    (allocated and freed inside the kernel) as one extra point of the timeline after the op."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    live.track(t)
            if scratch is not None:
                extra = scratch(func, args, out)
                if extra:
                    live.live += extra
                    live.tick()
                    live.live -= extra
            live.tick()
            return out

    return Mode()


def _one_step(config: dict[str, Any], batch: int, seq: int, recipe: str, attention: str,
              recompute: str, target: Target | None = None, linear: str = "aten") -> dict[str, Any]:
    """Trace one micro-step of ``batch`` sequences of ``seq`` tokens for ``target``: the live-bytes timeline, op by
    op (memplan/substitutes.py: what runs in place of the fake CPU tensors' kernels)."""
    import contextlib

    import torch
    import torch.nn.functional as F
    import transformers.masking_utils as mu
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from memplan.model.meta_builder import hf_config

    dtype, autocast = trace_dtypes(recipe)
    cfg = hf_config(config)
    impl = "eager" if attention == "eager" else "sdpa"
    import logging

    import transformers

    real_sdpa = F.scaled_dot_product_attention
    kernels: dict[str, str] = {}
    real_dropout = F.dropout
    real_linear = F.linear
    # fake-tensor kernels that refuse an input log a traceback before raising; the raise is what we report
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_level, tf_level = fake_log.level, transformers.logging.get_verbosity()
    fake_log.setLevel(logging.CRITICAL)
    transformers.logging.set_verbosity_error()
    # packed-sequence detection reads values (.item()), which fake tensors do not have: one unpacked sequence
    real_packed = getattr(mu, "find_packed_sequence_indices", None)
    # MoE experts run through grouped_mm. Its fake (meta) kernel takes bf16 only
    # (torch/_meta_registrations.py _meta_grouped_mm_common), while the real kernels also run fp32 weights
    # (torch-amp, fp32 recipes) through a fallback; for those the trace takes transformers' own fallback op
    # (transformers::grouped_mm_fallback), which saves the same two tensors for backward (input, weight).
    moe = None
    if dtype == "float32" and moe_experts(config):
        import transformers.integrations.moe as moe
    real_can_grouped = getattr(moe, "_can_use_grouped_mm", None)
    target = target or Target(device="cuda")
    cuda = target.device == "cuda"
    # a GPU job's autocast is CUDA's (substitutes.CudaAutocast), on the CPU tensors the trace runs
    policy = sub.CudaAutocast("bfloat16") if cuda and autocast else contextlib.nullcontext()
    try:
        if real_can_grouped is not None:
            moe._can_use_grouped_mm = lambda *a, **k: False
        if attention in ("flash", "sdpa"):
            F.scaled_dot_product_attention = sub.sdpa(real_sdpa, target, kernels)
        if cuda:
            F.dropout = sub.cuda_dropout()
        if linear == "deepspeed-zero3":
            F.linear = sub.deepspeed_zero3_linear("cpu")  # the traced tensors are (fake) CPU tensors
        if real_packed is not None:
            mu.find_packed_sequence_indices = lambda position_ids: None
        with FakeTensorMode(allow_non_fake_inputs=True), policy:
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=getattr(torch, dtype))
            if recompute == "full":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            params = list(model.parameters())
            live = _LiveBytes(K.CUDA_BLOCK if cuda else 1)
            for t in params + list(model.buffers()):
                live.ignore(t)
            param_storages = {id(p.untyped_storage()) for p in params}
            block_of, block_list = _block_index(model)
            #: live bytes and timeline index when each block's forward begins, and the index when it ends (its
            #: first call: not a recomputation in backward)
            forward_starts: dict[int, tuple[int, int]] = {}
            forward_ends: dict[int, int] = {}
            #: timeline index at which the gradient of each block's input is complete: the block's backward is
            #: over (all its nodes ran and released what they saved). FSDP's post-backward hook (reduce) fires
            #: then: FSDP2 applies RegisterPostBackwardFunction to the block's inputs
            #: (torch/distributed/fsdp/_fully_shard/_fsdp_state.py _pre_forward), FSDP1 hooks the same moment.
            backward_ends: dict[int, int] = {}
            #: the same moments as indices into live.events (fs, fe: forward start, end; bs, be: backward)
            regions: dict[str, dict[int, int]] = {"fs": {}, "fe": {}, "bs": {}, "be": {}}

            def note_start(i: int) -> Any:
                def hook(_mod: Any, args: Any, kwargs: Any) -> None:
                    if i in forward_starts:
                        return  # a recomputation in backward
                    forward_starts[i] = (live.live, len(live.timeline))
                    regions["fs"][i] = len(live.events)
                    x = args[0] if args else kwargs.get("hidden_states")
                    if isinstance(x, torch.Tensor) and x.requires_grad:
                        def done(_grad: Any) -> None:
                            live.tick()
                            backward_ends.setdefault(i, len(live.timeline) - 1)
                            regions["be"].setdefault(i, len(live.events))
                        x.register_hook(done)
                return hook

            #: timeline index at which the gradient of each block's output is complete: its backward begins.
            #: FSDP2's pre-backward (unshard) is a hook on the block's outputs (_fsdp_state.py
            #: _register_pre_backward_hook: t.register_hook(self._pre_backward)); DeepSpeed ZeRO-3 gathers at the
            #: same moment (PreBackwardFunctionForModule applied to the outputs). For the last block that is after
            #: the final norm's whole backward, not at its weight's gradient.
            backward_starts: dict[int, int] = {}

            def note_end(i: int) -> Any:
                def hook(_mod: Any, _args: Any, out: Any) -> None:
                    if i in forward_ends:
                        return  # a recomputation in backward
                    forward_ends[i] = len(live.timeline)
                    regions["fe"][i] = len(live.events)
                    y = out[0] if isinstance(out, (tuple, list)) and out else out
                    if isinstance(y, torch.Tensor) and y.requires_grad:
                        def begun(_grad: Any) -> None:
                            live.tick()
                            backward_starts.setdefault(i, len(live.timeline) - 1)
                            regions["bs"].setdefault(i, len(live.events))
                        y.register_hook(begun)
                return hook

            for i, blk in enumerate(block_list):
                blk.register_forward_pre_hook(note_start(i), with_kwargs=True)
                blk.register_forward_hook(note_end(i))
            #: (timeline index at which the gradient was created, block index or -1, numel), per parameter
            grads: list[tuple[int, int, int]] = []
            #: per entry of grads: the timeline index from which its post-accumulate hook has run (a strategy
            #: that takes each gradient in that hook, as ZeRO does, holds it only until then)
            hooked: list[int] = []
            #: per entry of grads: the timeline index of its hook's own moment
            hook_points: list[int] = []

            #: per parameter used more than once (a tied embedding): its first gradient contribution (see
            #: _first_contributions)
            first_contrib: dict[int, list[Any]] = {}
            root_firsts: list[tuple[int, int]] = []

            def drop_grad(p: Any) -> None:
                # the hook's own moment (a strategy's hook works here: ZeRO reduces, DeepSpeed's offload takes
                # the norm): activations then, the gradient itself taken out below
                live.tick()
                hook_at = len(live.timeline) - 1
                first = first_contrib.get(id(p))
                if first is not None and first[0] is not None and first[0]() is not p.grad.untyped_storage():
                    # gradient bytes from the head's backward on, not activations (in place or not, see above)
                    live.not_activation_between(first[1], first[2] if first[2] is not None else len(live.timeline),
                                                first[3])
                if first is not None and first[1] is not None:
                    # the loss segment counts a tied weight's gradient from its first contribution on
                    root_firsts.append((first[1], p.grad.numel()))
                live.mark_grad(p.grad, block_of.get(id(p), -1))
                born = live.not_activation(p.grad)
                if born is not None:
                    grads.append((born, block_of.get(id(p), -1), p.grad.numel()))
                    hooked.append(len(live.timeline) + 1)
                    hook_points.append(hook_at)
                p.grad = None

            for p in params:
                p.register_post_accumulate_grad_hook(drop_grad)
            saved: dict[int, int] = {}

            def pack(t: Any) -> Any:
                st = t.untyped_storage()
                if id(st) not in param_storages:
                    saved.setdefault(id(st), live.nbytes(st))
                return t

            ids = torch.zeros(batch, seq, dtype=torch.long)
            with _mode(live, None if cuda else sub.gemm_scratch(target.cpu_isa, target.cpu_threads)):
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        loss = model(input_ids=ids, labels=ids).loss
                live.tick()
                forward_end = len(live.timeline)
                regions["forward_end"] = len(live.events)  # type: ignore[assignment]
                after_forward = live.live
                _first_contributions(loss, live, first_contrib)
                loss.backward()
                live.tick()
                del loss
    finally:
        fake_log.setLevel(fake_level)
        transformers.logging.set_verbosity(tf_level)
        F.scaled_dot_product_attention = real_sdpa
        F.dropout = real_dropout
        F.linear = real_linear
        if real_packed is not None:
            mu.find_packed_sequence_indices = real_packed
        if real_can_grouped is not None:
            moe._can_use_grouped_mm = real_can_grouped
    timeline = live.corrected()
    blocks = _block_segments(timeline, grads, forward_end, backward_ends, hooked, backward_starts)
    return {"saved": sum(saved.values()), "live": after_forward, "forward": timeline[:forward_end],
            "backward": timeline[forward_end - 1:],
            "blocks": blocks,
            "hooks": _block_hooks(timeline, grads, hook_points),
            "root_hooks_done": _root_hooks_done(timeline, grads, hook_points, forward_end, backward_starts),
            "loss_backward": _loss_segment(timeline, grads, root_firsts, forward_end, blocks, backward_starts),
            "attention_kernels": kernels,
            "events": live.events, "regions": regions,
            "last_block_forward_start": forward_starts.get(len(block_list) - 1, (0, 0))[0],
            "last_block_forward": timeline[forward_starts.get(len(block_list) - 1, (0, 0))[1]:
                                           forward_ends.get(len(block_list) - 1, 0) + 1]}


def _block_index(model: Any) -> tuple[dict[int, int], list[Any]]:
    """id(parameter) -> index of the decoder block that owns it (the longest ModuleList of the model: the unit
    FSDP and DeepSpeed wrap; parameters outside it are not in the map), and the blocks."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return {}, []
    blocks = max(lists, key=len)
    return {id(p): i for i, blk in enumerate(blocks) for p in blk.parameters()}, list(blocks)


def _first_contributions(loss: Any, live: _LiveBytes, out: dict[int, list[Any]]) -> None:
    """Hooks the first gradient contribution to each parameter the graph reaches more than once (a tied
    embedding: the head's matmul, then the embedding). Its bytes are gradient bytes from the head's backward to
    the end, which the strategy accounts for (the head's grads), not activations. The real engine adds the later
    contributions into the first in place where it can steal the buffer (torch/csrc/autograd/input_buffer.cpp,
    accumulate), so the first contribution becomes the gradient: gpt2 under torch-amp, where the profiler shows
    the embedding's 2 MB contribution freed right after its add and no new storage; where it cannot (measured
    with a bf16 weight, or an fp32 weight without autocast) it adds out of place at the end, and the first
    contribution lives until then. A fake-tensor run always adds out of place (a tensor subclass is never
    stolen), which would leave the first contribution in the timeline as an activation until the end.
    ``out[id(param)]`` = [storage weakref, birth, death, bytes, data_ptr (real tensors only)]."""
    from torch._subclasses.fake_tensor import FakeTensor

    incoming: dict[Any, list[tuple[Any, int]]] = {}
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for i, (nxt, _) in enumerate(fn.next_functions):
            if nxt is None:
                continue
            if hasattr(nxt, "variable"):  # AccumulateGrad: a leaf
                incoming.setdefault(nxt, []).append((fn, i))
            else:
                stack.append(nxt)
    for acc, edges in incoming.items():
        if len(edges) < 2:
            continue
        key = id(acc.variable)

        def hook(grad_inputs: Any, _grad_outputs: Any, pos: int = 0, key: int = key) -> None:
            g = grad_inputs[pos]
            if g is None or key in out:
                return
            st = g.untyped_storage()
            rec = [None, live._born.get(id(st), len(live.timeline)), None, live.nbytes(st),
                   None if isinstance(g, FakeTensor) else g.data_ptr()]

            def died(_ref: Any, rec: list[Any] = rec) -> None:
                rec[2] = len(live.timeline)

            rec[0] = weakref.ref(st, died)
            out[key] = rec

        for fn, i in edges:
            fn.register_hook(lambda gi, go, i=i, h=hook: h(gi, go, pos=i))


def _block_segments(timeline: list[int], grads: list[tuple[int, int, int]], forward_end: int,
                    ends: dict[int, int] | None = None, hooked: list[int] | None = None,
                    starts: dict[int, int] | None = None) -> list[list[list[int]]]:
    """Each block's backward, last block first: the points [activation bytes, the block's parameter-gradient
    elements created so far, those of them whose post-accumulate hook has not run yet (``hooked``: per entry of
    ``grads``, the index from which it has; without it, none counted)], from the end of the previous block's
    backward (or of the loss and head's: when the gradient of its output is complete, ``starts``: block ->
    timeline index, or without that, after the last gradient of what ran before it) to the end of its own: when
    the gradient of its input is complete (``ends``: block -> timeline index), or without that, the creation of
    its last parameter gradient. The recomputation of a checkpointed block falls inside its segment. A strategy
    that keeps a block's unsharded gradients until the block's backward ends (FSDP) adds them at its own
    gradient dtype; activations alone miss the moment where the two together peak."""
    ends, starts = ends or {}, starts or {}
    by_block: dict[int, list[tuple[int, int]]] = {}
    pending: dict[int, list[tuple[int, int, int]]] = {}
    for i, (born, blk, numel) in enumerate(grads):
        if blk >= 0:
            by_block.setdefault(blk, []).append((born, numel))
            if hooked is not None:
                pending.setdefault(blk, []).append((born, hooked[i], numel))
    segments = []
    start = forward_end
    for blk in sorted(by_block, reverse=True):
        events = sorted(by_block[blk])
        first, end = events[0][0], max(events[-1][0], ends.get(blk, 0))
        # the segment starts after the last gradient of anything that ran before this block in backward
        before = [born for born, b, _ in grads if born < first and b != blk]
        start = max([start] + [x + 1 for x in before])
        if blk in starts and start <= starts[blk] <= first:
            start = starts[blk]
        points, done, k = [], 0, 0
        held = pending.get(blk, [])
        for t in range(start, end + 1):
            while k < len(events) and events[k][0] <= t:
                done += events[k][1]
                k += 1
            points.append([timeline[t], done, sum(n for b, h, n in held if b <= t < h)])
        segments.append(points)
        # the next block's backward begins where this one's ends (the input's gradient is its output's)
        start = end if blk in ends else end + 1
    return segments


def _block_hooks(timeline: list[int], grads: list[tuple[int, int, int]],
                 points: list[int]) -> list[list[list[int]]]:
    """Per block, last first (as _block_segments): [activation bytes at the parameter's post-accumulate hook,
    its gradient's elements] for each of its parameters, in backward order. A strategy that works on each
    gradient in that hook (DeepSpeed's offload: a reduced partition and its fp64 copy for the norm) adds its
    transient to the activations of that moment."""
    by_block: dict[int, list[list[int]]] = {}
    for (born, blk, numel), at in zip(grads, points):
        if blk >= 0:
            by_block.setdefault(blk, []).append([timeline[at], numel])
    return [by_block[b] for b in sorted(by_block, reverse=True)]


def _root_hooks_done(timeline: list[int], grads: list[tuple[int, int, int]], points: list[int], forward_end: int,
                     starts: dict[int, int] | None = None) -> int | None:
    """Activations at the hook of the last parameter outside the blocks whose gradient is made before the last
    block's backward (the final norm's, after the head's), or None. A gradient hook is where DeepSpeed works:
    ZeRO-1/2 set up their reduce bucket at the first (the head's), and ZeRO-3 reduces a bucket that the next
    parameter's gradient would overflow at that parameter's hook, so a head larger than the bucket is reduced,
    with ZeRO-Offload's transient, at the final norm's."""
    start = _segment_start(grads, forward_end, starts)
    before = [at for (born, blk, _), at in zip(grads, points) if blk < 0 and born < start]
    return timeline[max(before)] if before else None


def _loss_segment(timeline: list[int], grads: list[tuple[int, int, int]], firsts: list[tuple[int, int]],
                  forward_end: int, blocks: list[list[list[int]]],
                  starts: dict[int, int] | None = None) -> list[list[int]]:
    """The loss's and the head's backward, up to the last block's backward: the points [activation bytes, the
    gradient elements of parameters outside the blocks created so far (the head's; a tied weight's from its
    first contribution)]. Autograd makes each weight gradient as a new tensor (the head's GEMM writes it), so
    every strategy holds it on top of what it keeps, at least until its hook has taken it: the moment of the
    head's weight-gradient GEMM (its output and, on CPU, the GEMM's fp32 scratch) can top the loss's own."""
    # the blocks' segments run back to back from the end of this one (see _block_segments). A tied weight's
    # own gradient entry is born at the embedding's backward, after every block: past this segment.
    end = _segment_start(grads, forward_end, starts) - 1 if blocks else len(timeline) - 1
    events = sorted([(born, numel) for born, blk, numel in grads if blk < 0] + list(firsts))
    points, done, k = [], 0, 0
    for t in range(forward_end - 1, max(end, forward_end - 1) + 1):
        while k < len(events) and events[k][0] <= t:
            done += events[k][1]
            k += 1
        points.append([timeline[t], done])
    return points


def _segment_start(grads: list[tuple[int, int, int]], forward_end: int,
                   starts: dict[int, int] | None = None) -> int:
    """Where the last block's backward segment begins (as _block_segments places it)."""
    blks = [blk for _, blk, _ in grads if blk >= 0]
    if not blks:
        return forward_end
    last = max(blks)
    first = min(born for born, blk, _ in grads if blk == last)
    before = [born for born, b, _ in grads if born < first and b != last]
    start = max([forward_end] + [x + 1 for x in before])
    at = (starts or {}).get(last)
    return at if at is not None and start <= at <= first else start


def _alloc_events(a: dict[str, Any], b: dict[str, Any], *, expand: bool) -> dict[str, Any] | None:
    """The traced step as the caching allocator sees it, from its runs at micro-batch 2 and 4: "events" in order,
    a storage's birth [c0, c1] (c0 + c1*b bytes at micro-batch b; a third item, the block of the parameter whose
    gradient it is, -1 outside the blocks) or a death (the id of the storage: the number of births before its
    own). "fs", "fe", "bs", "be": per traced block, the event index at which its forward starts and ends and its
    backward starts and ends (the gradient of its output, then of its input, complete); "expand": the blocks
    are alike and memplan/reserved.py repeats them to the model's depth. None where the two runs differ."""
    ea, eb = a["events"], b["events"]
    if len(ea) != len(eb) or a["regions"] != b["regions"]:
        return None
    out: list[Any] = []
    for x, y in zip(ea, eb):
        if isinstance(x, list):
            if not isinstance(y, list) or x[1:] != y[1:]:
                return None
            slope = (y[0] - x[0]) // 2
            out.append([x[0] - 2 * slope, slope] + x[1:])
        elif x != y:
            return None
        else:
            out.append(x)
    r = a["regions"]
    n = len(r["fs"])
    if any(sorted(r[k]) != list(range(n)) for k in ("fs", "fe", "bs", "be")):
        return None
    return {"events": out, "expand": expand, "forward_end": r["forward_end"],
            **{k: [r[k][i] for i in range(n)] for k in ("fs", "fe", "bs", "be")}}


def moe_experts(config: dict[str, Any]) -> int:
    """The number of routed experts a config declares (0 for a dense model)."""
    for k in ("num_local_experts", "n_routed_experts", "num_experts"):
        v = config.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def _envelope(lines: list[tuple[int, ...]]) -> list[list[int]]:
    """The lines (c0 + c1*b, then any payload) that are the maximum for some micro-batch b >= 1 (upper
    envelope)."""
    best: dict[int, tuple[int, ...]] = {}
    for line in lines:
        c0, c1 = line[0], line[1]
        if c1 not in best or best[c1][0] < c0:
            best[c1] = tuple(line)
    keep: list[tuple[int, ...]] = []
    for c1 in sorted(best):  # by slope
        line = best[c1]
        # drop lines below this one for every b >= 1 (smaller slope and smaller value at b=1)
        while keep and keep[-1][0] + keep[-1][1] <= line[0] + line[1]:
            keep.pop()
        keep.append(line)
    return [list(x) for x in keep]


#: the gradient widths (bytes per element) a strategy may keep a block's unsharded gradients in
GRAD_WIDTHS = (2, 4)


_HETEROGENEOUS_KEYS = ("first_k_dense_replace", "layer_types", "mlp_only_layers", "decoder_sparse_step",
                       "moe_layer_freq", "sliding_window_pattern")


def trace_profile(config: dict[str, Any], *, seq_len: int, recipe: str, attention: str,
                  recompute: str, device: str = "cuda", linear: str = "aten",
                  target: Target | None = None) -> dict[str, Any]:
    """The activation profile of one micro-step at ``seq_len``, as lines c0 + c1*b in the micro-batch b.

    Traced with 1 and 2 blocks (all blocks alike) or at full depth (blocks that differ: dense then MoE,
    sliding then global attention), each for b = 2 and b = 4 (b = 1 takes shortcuts such as squeezes, so its
    timeline has other operations). Every timeline point is a line in b; what does not scale with the batch
    (autocast's weight copies, a tied embedding's partial gradient) lands in c0. A model of L blocks adds
    (L - traced) x the per-block bytes to every peak: exact when the peak falls while every block's activations
    are alive (forward end, loss, early backward), an upper bound when it falls late in backward.
    """
    import transformers

    from memplan.model.scaling import scale_config

    if trace_dtypes(recipe) is None:
        raise SettingsError(f"cannot trace activations for precision {recipe}")
    target = target or K.host_target(device)
    key = next((k for k in ("num_hidden_layers", "n_layer", "num_layers") if config.get(k)), None)
    if key is None:
        raise SettingsError("the config has no layer count; use --activations analytic")
    layers = int(config[key])
    # blocks that differ are traced at full depth; a one-block model too (there is no second depth to subtract)
    heterogeneous = layers < 2 or any(config.get(k) for k in _HETEROGENEOUS_KEYS)

    def run(depth: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
        cfg = scale_config(config, layers=depth)[0] if depth else config
        a = _one_step(cfg, 2, seq_len, recipe, attention, recompute, target, linear)
        b = _one_step(cfg, 4, seq_len, recipe, attention, recompute, target, linear)
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

    def block_backward(seg_a: list[list[int]], seg_b: list[list[int]]) -> dict[str, Any]:
        """One block's backward: per gradient width w, the envelope of [c0, c1, g] where activations are
        c0 + c1*b and the block's gradients so far g elements, ranked by c0 + c1*b + w*g."""
        if len(seg_a) != len(seg_b) or any(x[1] != y[1] for x, y in zip(seg_a, seg_b)):
            raise SettingsError("the traced backward runs different operations at micro-batch 2 and 4; "
                                "use --activations analytic")
        pts = [line(x[0], y[0]) + [x[1]] for x, y in zip(seg_a, seg_b)]
        # activations when the block's backward begins and when it ends (its input's gradient complete)
        out: dict[str, Any] = {"start": pts[0][:2], "end": pts[-1][:2]}
        for w in GRAD_WIDTHS:
            env = _envelope([(c0 + w * g, c1, c0, g) for c0, c1, g in pts])
            out[str(w)] = [[c0, c1, g] for _, c1, c0, g in env]
        if all(len(x) > 2 for x in seg_a):
            # the same with only the gradients whose hook has not run yet ("held2", "held4": ZeRO takes each
            # gradient in its hook)
            held = [p[:2] + [x[2]] for p, x in zip(pts, seg_a)]
            for w in GRAD_WIDTHS:
                env = _envelope([(c0 + w * g, c1, c0, g) for c0, c1, g in held])
                out[f"held{w}"] = [[c0, c1, g] for _, c1, c0, g in env]
        return out

    segs = [(x, y) for x, y in zip(top[0]["blocks"], top[1]["blocks"])]
    blocks = [block_backward(x, y) for x, y in segs[:2]]
    first = block_backward(*segs[-1]) if segs else None
    loss_bwd = block_backward(top[0]["loss_backward"], top[1]["loss_backward"])

    def hooks(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
        if len(a) != len(b) or any(x[1] != y[1] for x, y in zip(a, b)):
            raise SettingsError("the traced backward runs different operations at micro-batch 2 and 4; "
                                "use --activations analytic")
        return [line(x[0], y[0]) + [x[1]] for x, y in zip(a, b)]

    hk = [hooks(x, y) for x, y in zip(top[0]["hooks"], top[1]["hooks"])]
    for blk, h in zip(blocks, hk[:2]):
        blk["hooks"] = h
    if first is not None and hk:
        first["hooks"] = hk[-1]
    return {
        "version": PROFILE_VERSION,
        "seq_len": seq_len, "recipe": recipe, "attention": attention, "recompute": recompute, "device": device,
        "target": target.key,
        "num_layers": layers, "traced_layers": layers if heterogeneous else 2,
        "live_after_forward": live,  #: at the traced depth
        "per_layer": per_layer,  #: one more block (zero when traced at full depth)
        "saved_for_backward": line(top[0]["saved"], top[1]["saved"]),
        "forward_peak": envelope("forward"),
        "backward_peak": envelope("backward"),
        #: the last and the one-before-last block's backward with their own gradients (see _block_segments)
        "block_backward": blocks,
        #: the first block's backward (the last to run), with no block below it
        "first_block_backward": first,
        #: the loss's and the head's backward with the gradients of the parameters outside the blocks (see
        #: _loss_segment), every block's saved activations below it
        "loss_backward": loss_bwd,
        #: live bytes at the last hook of a parameter outside the blocks before them (see _root_hooks_done)
        "root_hooks_done": (line(top[0]["root_hooks_done"], top[1]["root_hooks_done"])
                            if top[0]["root_hooks_done"] is not None and top[1]["root_hooks_done"] is not None
                            else None),
        #: live bytes when the last block's forward begins (everything before it saved, nothing of the loss)
        "last_block_forward_start": line(top[0]["last_block_forward_start"], top[1]["last_block_forward_start"]),
        #: the most live during the last block's forward (its own activations and temporaries)
        "last_block_forward_peak": envelope("last_block_forward") if top[0]["last_block_forward"] else [[0, 0]],
        #: the SDPA kernels the step ran ("fused", "math") and why the math one
        "attention_kernels": top[0]["attention_kernels"],
        #: the step's storages in order, for the caching allocator (see _alloc_events; None: not linear in b)
        "alloc_events": _alloc_events(*top, expand=not heterogeneous),
        "transformers": transformers.__version__,
    }

