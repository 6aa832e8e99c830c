"""The reserved-peak replay of FSDP2 (fully_shard's setup, unshard, all-gather, copy-out and reduce-scatter order)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.allocator import Allocator, AllocatorConfig
from memplan.replay import (
    MAX_STEPS,
    ReplayJob,
    Run,
    build_model,
    micro_step,
    optimizer_step,
)


@dataclass(frozen=True)
class FsdpGroup:
    """One fully_shard unit (a block, or the root with what no block holds), per rank."""

    params: tuple[int, ...]  #: its parameters' positions in module order
    shard: tuple[int, ...]  #: bytes of each sharded parameter (dim 0 padded to the shard count), stored dtype
    unsharded: tuple[int, ...]  #: bytes of each unsharded parameter in the compute dtype
    cast: bool  #: the all-gather input is a cast of the shard (MixedPrecisionPolicy param_dtype differs)
    reduce_in: int  #: the reduce-scatter input: every padded gradient in the reduce dtype
    reduce_out: int  #: its output: this rank's sharded gradients, which the .grad views keep
    #: bytes of each parameter's post-forward share where reshard_after_forward is a group size (the padded
    #: unsharded parameter over that many ranks, in the compute dtype: to_sharded_post_forward); () otherwise
    post_forward: tuple[int, ...] = ()
    #: off CUDA, torch._chunk_cat's composite pads each gradient into a temporary in the grad dtype before copying
    #: it into the reduce-scatter input (frameworks/fsdp2.py cpu_chunk): the largest one, bytes; 0 on CUDA
    chunk_tmp: int = 0
    #: CPUOffloadPolicy: the shards and sharded gradients live on the host, the optimizer steps there
    offload: bool = False
    #: elements of each parameter padded on dim 0 to the shard count (what its shards and the all-gather output
    #: hold: a dim 0 smaller than the ranks, as an MoE's stacked experts at 64 ranks, is padded to one row each)
    padded: tuple[int, ...] = ()
    unshard_bytes: int = 0  #: bytes per unsharded element (the all-gather's dtype)
    #: bytes per unsharded element of each parameter where they differ (float8's all-gather: one for a float8
    #: weight, unshard_bytes for the rest; () : unshard_bytes for all)
    elem_bytes: tuple[int, ...] = ()
    #: sharded on dim 1 (an expert-parallel rank's experts over more expert-FSDP ranks than it holds experts:
    #: layouts.shard_dim), so each parameter's copy-out goes through a temporary (foreach_all_gather_copy_out)
    dim1: bool = False

    def per(self, i: int) -> int:
        """Bytes per unsharded element of parameter i."""
        return self.elem_bytes[i] if self.elem_bytes else self.unshard_bytes


#: the allocator's stream for FSDP2's reduce-scatter outputs (its own pool; any id but the default's)
RS_STREAM = 2
AG_STREAM = 1


def _unshard(run: Run, g: FsdpGroup, world: int) -> list[Any]:
    """FSDPParamGroup.unshard + wait_for_unshard with one rank: no all-gather (unshard() records an empty
    result); each unsharded parameter is made from its shard when the block runs, each cast (when the compute
    dtype differs) freed after the next one is made (measured: ../shared/gpu/traces/fsdp_full_rc)."""
    keys = []
    prev = None
    for i, n in enumerate(g.unsharded):
        h2d = run.alloc(g.shard[i]) if g.offload else None  # CPUOffloadPolicy: the shard copied to the device
        cast = run.alloc(n) if g.cast else None
        if h2d is not None and cast is not None:
            run.free(h2d)
            h2d = None
        if prev is not None:
            run.free(prev)
        keys.append(run.alloc(n))
        prev = cast if cast is not None else h2d
    if prev is not None:
        run.free(prev)
    return keys


def _all_gather(run: Run, g: FsdpGroup, world: int) -> Any:
    """FSDPParamGroup.unshard with more ranks (_fsdp_collectives.py foreach_all_gather), on the copy-in stream:
    the shards cast into one flat buffer in param_dtype (_get_param_all_gather_inputs' fast path,
    flat_foreach_copy_input), then the flat all-gather output they are copied into; the output is returned,
    the cast buffer freed."""
    # the all-gather's input and output in the unsharded dtype: each padded shard, then every rank's
    per = g.unshard_bytes
    shards = sum(p // world * g.per(i) for i, p in enumerate(g.padded)) if g.padded else \
        sum(-(-n // world) for n in g.unsharded)
    if g.elem_bytes and not g.offload:
        # float8's all-gather (torchao fsdp_pre_all_gather): each float8 weight's shard cast on its own, the
        # others' in one flat param_dtype buffer (the foreach fast path), then the byte (uint8) output; the
        # inputs freed after the copy-in
        inputs = [run.alloc(p // world, stream=AG_STREAM) for i, p in enumerate(g.padded) if g.per(i) != per]
        rest = sum(p // world * per for i, p in enumerate(g.padded) if g.per(i) == per)
        if g.cast and rest:
            inputs.append(run.alloc(rest, stream=AG_STREAM))
        flat = run.alloc(shards * world, stream=AG_STREAM)
        for k in inputs:
            run.free(k)
        return flat
    if g.offload:
        # CPUOffloadPolicy (no foreach fast path: _get_param_all_gather_inputs' use_foreach_copy is False): each
        # shard copied to the device (FSDPParam.all_gather_inputs: .to(device)), then cast to param_dtype (the
        # copy freed), the inputs held until the copy-in into the output
        inputs = []
        for i, stored in enumerate(g.shard):
            h2d = run.alloc(stored, stream=AG_STREAM)
            if g.cast:
                inputs.append(run.alloc(g.padded[i] // world * per if g.padded else -(-g.unsharded[i] // world),
                                        stream=AG_STREAM))
                run.free(h2d)
            else:
                inputs.append(h2d)
        flat = run.alloc(shards * world, stream=AG_STREAM)
        for k in inputs:
            run.free(k)
        return flat
    cast = run.alloc(shards, stream=AG_STREAM) if g.cast else None
    flat = run.alloc(shards * world, stream=AG_STREAM)
    if cast is not None:
        run.free(cast)
    return flat


def _all_gather_post_forward(run: Run, g: FsdpGroup, group: int) -> Any:
    """The all-gather of a unit resharded after forward to ``group`` ranks (SHARDED_POST_FORWARD): its inputs are
    the post-forward shares, already in param_dtype, copied straight into the flat output (foreach_all_gather's
    input is a view of the output), so only the output is allocated."""
    return run.alloc(sum(g.post_forward) * group, stream=AG_STREAM)


def _copy_out(run: Run, g: FsdpGroup) -> list[Any]:
    """wait_for_unshard's foreach_all_gather_copy_out: each parameter's all_gather_outputs buffer, on the default
    stream, padded on dim 0 as its shards are (split_with_sizes_copy into it; the unsharded parameter is an
    as_strided view of it at the original size: _fsdp_param.py init_all_gather_outputs, init_unsharded_param)."""
    if g.dim1:
        # a parameter sharded on another dim than 0: its output, then an empty_like temporary the flat output is
        # split into, each chunk-cat'ed into its output afterwards and freed with the list that holds them
        # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_all_gather_copy_out)
        out, tmp = [], []
        for i, p in enumerate(g.padded):
            out.append(run.alloc(p * g.per(i)))
            tmp.append(run.alloc(p * g.per(i)))
        for k in tmp:
            run.free(k)
        return out
    if g.padded:
        return [run.alloc(p * g.per(i)) for i, p in enumerate(g.padded)]
    return [run.alloc(n) for n in g.unsharded]


#: unit keys beside the blocks' positions (--fsdp-wrap block+embeddings: torchtitan's embedding and head units)
ROOT, EMB, HEAD = -1, -2, -3
#: a block's experts unit (expert parallelism): XOFF + the block's position
XOFF = 1 << 20
#: the traced step's marks of the experts module inside a block (replay.py INNER_MARKS)
EXPERT_KINDS = frozenset({"XF", "XFE", "XB", "XR", "XRE", "XBE"})


def replay_fsdp2(job: ReplayJob, groups: tuple[FsdpGroup, ...], world: int, reshard_after_forward: bool | int,
                 config: AllocatorConfig | None = None, emb: FsdpGroup | None = None,
                 head: FsdpGroup | None = None, root_reshards: bool = False,
                 experts: dict[int, FsdpGroup] | None = None, experts_world: int = 0) -> Allocator:
    """FSDP2 (torch/distributed/fsdp/_fully_shard): fully_shard on each block then the root. Setup replaces each
    parameter by its padded shard, a group's new shards made before its old parameters go (_fsdp_param.py
    _init_sharded_param). In a step the root unshards at the forward's start and stays unsharded; each block
    unshards before its forward and, resharding after forward, again before its backward; after a block's
    backward (post_backward) its gradients go into one reduce-scatter input in the reduce dtype, then the
    unsharded gradients are freed and the output (on the reduce-scatter stream) is allocated, whose views
    are the sharded .grad until zero_grad; the optimizer steps the shards. ``groups``: the blocks in order,
    the root last (--fsdp-wrap none: the root alone, holding every parameter; its gradients are reduced at the
    end). ``emb``, ``head``: --fsdp-wrap block+embeddings (torchtitan's parallelize: the input embedding
    fully_shard-ed first, resharded after its forward like a block, unsharded again before its backward,
    prefetched by the first block's pre-backward, reduced last; the final norm with the head one unit not
    resharded after forward, reduced right after its backward; the root then holds nothing).

    Where the model's forward returns (the loss computed inside it, as transformers' models do) the root's
    _post_forward (_fsdp_state.py) frees the last all-gather result and, when the root reshards after forward
    (``root_reshards``: fully_shard(model) given reshard_after_forward=True, as Accelerate's fsdp2_prepare_model
    passes it; without the argument _lazy_init sets the root's post_forward_mesh_info to None and it is kept),
    its unsharded parameters; backward's first hook, the root's _pre_backward, unshards it again and prefetches
    the last block (recorded on the H200: bench/gpu/traces/l8b_fsdp, the embedding's and head's 1 GiB copies
    freed after the loss and made again before the head's backward).

    ``experts`` (expert parallelism), by block: each block's experts module, its own unit over ``experts_world``
    ranks inside the block's (_MicroStep.experts_at: where the traced step marks the module's forward and
    backward)."""
    run = Run(config or AllocatorConfig(), job.buffers)
    experts = experts or {}
    order = [g for g in (emb,) if g is not None] + [x for i, b in enumerate(groups[:-1])
                                                     for x in (b, experts.get(i)) if x is not None] \
        + [g for g in (head,) if g is not None] + [groups[-1]]
    if any(g.offload for g in order):
        pass  # CPUOffloadPolicy: built, sharded and kept on the host (torchtitan's init_device "cpu")
    elif world == 1 or job.quantized or job.packed:
        # one rank: built on the device, then each group's shards made and its parameters freed (measured). A 4-bit
        # base (QLoRA) too at any world size: transformers' bitsandbytes quantizer loads the whole model onto the
        # rank's device (Bnb4BitHfQuantizer.update_device_map: {"": current device}) and Accelerate 1.15's
        # fsdp2_prepare_model does not move a model with Params4bit to the meta device first ("bypassing the move
        # to meta will still cause the VRAM spike"), so fully_shard shards it from the device
        built = build_model(run, job)
        for g in order:
            for n in g.shard:
                run.alloc(n)
            for i in g.params:
                run.free(built[i])
    else:
        # more ranks: the full model never fits one device at the sizes FSDP is for; it is built on the meta
        # device, sharded, then materialized shard by shard (to_empty + init, torchtitan's recipe)
        for g in order:
            for n in g.shard:
                run.alloc(n)
    blocks, root = groups[:-1], groups[-1]
    states: list[Any] = []
    for n in range(MAX_STEPS):
        before = run.a.peak_reserved
        outputs: list[Any] = []
        for m in range(job.grad_accum):
            ids = run.alloc(job.input_bytes)
            _fsdp_micro_step(run, job, blocks, root, world, reshard_after_forward, outputs,
                             first=n == 0 and m == 0, keep=m == 0, emb=emb, head=head, root_reshards=root_reshards,
                             experts=experts, experts_world=experts_world)
            run.free(ids)
        if not root.offload:  # offloaded: the optimizer steps the host's shards
            optimizer_step(run, job, n == 0, states)
        for k in outputs:
            run.free(k)
        run.end_step()
        if n >= 1 and run.a.peak_reserved == before:
            break
    return run.a


def _fsdp_micro_step(run: Run, job: ReplayJob, blocks: tuple[FsdpGroup, ...], root: FsdpGroup, world: int,
                     reshard_after_forward: bool | int, outputs: list[Any], first: bool, keep: bool,
                     emb: FsdpGroup | None = None, head: FsdpGroup | None = None, root_reshards: bool = False,
                     experts: dict[int, FsdpGroup] | None = None, experts_world: int = 0) -> None:
    """One micro-step under FSDP2; the reduce-scatter outputs go to ``outputs`` (``keep``), or, in a later
    micro-step, are added into the sharded gradients and freed. With more than one rank (frameworks/fsdp2.py's
    notes, each checked on the harness): in forward a block's all-gather output is held until the next block's
    copy-out (FSDPCommContext.all_gather_state), the last one to the root's post-forward; in backward the root's
    pre-backward prefetches the last block, a block's pre-backward copies out of its prefetched output (then
    frees it) and prefetches the next; a post-backward frees the previous reduce-scatter input
    (reduce_scatter_max_input_buffers = 1)."""
    st = _MicroStep(run, job, blocks, root, world, reshard_after_forward, outputs, first, keep, emb, head)
    st.root_reshards = root_reshards
    for i, g in (experts or {}).items():
        st.units[XOFF + i] = g
        st.worlds[XOFF + i] = experts_world
    st.unshard(ROOT, hold=True)
    # each gradient kept, by its unit, for that unit's post-backward
    micro_step(run, job, keep_grads=True, at=st.region,
               on_grad=lambda _size, key, blk: st.grads_of.setdefault(st.unit_of(blk), []).append(key),
               on_forward_end=st.forward_returned)
    if not st.returned:  # a profile traced before the forward's end was recorded
        st.forward_returned()
    if st.bwd is not None:  # the embedding's unit, the last to run backward
        st.post_backward(st.bwd)
        st.bwd = None
    st.post_backward(ROOT)
    for k in st.held:
        run.free(k)


class _MicroStep:
    """FSDP2's state through one micro-step: what is unsharded, prefetched, held, and each block's gradients."""

    def __init__(self, run: Run, job: ReplayJob, blocks: tuple[FsdpGroup, ...], root: FsdpGroup, world: int,
                 reshard_after_forward: bool | int, outputs: list[Any], first: bool, keep: bool,
                 emb: FsdpGroup | None = None, head: FsdpGroup | None = None) -> None:
        self.run, self.job, self.blocks, self.root, self.world = run, job, blocks, root, world
        self.units: dict[int, FsdpGroup] = dict(enumerate(blocks))
        self.units[ROOT] = root
        if emb is not None:
            self.units[EMB] = emb
        if head is not None:
            self.units[HEAD] = head
        self.be = emb is not None or head is not None
        self.kind = ""  #: the traced step's region running
        self.reshard_after_forward, self.outputs, self.first, self.keep = reshard_after_forward, outputs, first, keep
        self.flat = world > 1
        self.unsharded: dict[int, list[Any]] = {}
        self.gathered: dict[int, Any] = {}  # prefetched all-gather outputs, by block
        #: a reshard_after_forward group size: each block's post-forward shares, by block, until backward
        #: unshards it again (to_unsharded frees them after the copy-out)
        self.group = reshard_after_forward if reshard_after_forward is not True and not isinstance(
            reshard_after_forward, bool) else None
        self.shares: dict[int, list[Any]] = {}
        self.held: list[Any] = []  # forward: the last all-gather output; backward: the last reduce-scatter input
        self.grads_of: dict[int, list[Any]] = {}
        self.bwd: int | None = None
        self.forward: int | None = None  #: the block whose forward runs (it ends where the next region begins)
        self.root_reshards = False
        self.returned = False  #: the model's forward has returned (the root's post-forward has run)
        #: each unit's shard group where it is not ``world`` (an experts unit's)
        self.worlds: dict[int, int] = {}
        #: the block whose experts module's backward runs (its gradients are the experts unit's)
        self.in_experts: int | None = None

    def world_of(self, i: int) -> int:
        return self.worlds.get(i, self.world)

    def unit_of(self, blk: int) -> int:
        """The unit whose post-backward reduces a gradient of this block (-1: outside the blocks)."""
        if not self.blocks:
            return ROOT  # --fsdp-wrap none: the root holds every parameter
        if self.in_experts is not None and blk == self.in_experts:
            return XOFF + blk
        if blk >= 0 or not self.be:
            return blk
        if self.kind == "mid" and HEAD in self.units:
            return HEAD
        return EMB if EMB in self.units else ROOT

    def unshard(self, i: int, hold: bool) -> None:
        run = self.run
        g = self.units[i]
        if not g.params:
            return
        if self.world_of(i) == 1:
            self.unsharded[i] = _unshard(run, g, 1)
            return
        out = self.gathered.pop(i, None) or self._gather(i)
        self.unsharded[i] = _copy_out(run, g)
        for k in self.shares.pop(i, []):
            run.free(k)
        if hold:  # forward: free the previous output now, keep this one
            for k in self.held:
                run.free(k)
            self.held[:] = [out]
        else:
            run.free(out)

    def prefetch(self, i: int) -> None:
        if i == ROOT and self.be:
            i = EMB  # the first block's pre-backward prefetches the embedding's unit
        g = self.units.get(i)
        if self.world_of(i) > 1 and g is not None and g.params and i not in self.unsharded \
                and i not in self.gathered:
            self.gathered[i] = self._gather(i)

    def _gather(self, i: int) -> Any:
        g = self.units[i]
        if i in self.shares:
            assert self.group is not None  # resharding to a smaller group: set with the shares
            return _all_gather_post_forward(self.run, g, self.group)
        return _all_gather(self.run, g, self.world_of(i))

    def post_backward(self, i: int) -> None:
        run = self.run
        g = self.units[i]
        for k in self.unsharded.pop(i, []):  # reshard
            run.free(k)
        for k in self.held:
            run.free(k)
        self.held.clear()
        if not g.params or not g.reduce_in:  # no gradient in the unit (frozen under LoRA): nothing reduced
            self.grads_of.pop(i, None)
            return
        rs_in = run.alloc(g.reduce_in)
        if g.chunk_tmp:
            run.free(run.alloc(g.chunk_tmp))
        for k in self.grads_of.pop(i, []):
            run.free(k)
        out = run.alloc(g.reduce_out, stream=RS_STREAM)
        # the input is kept (FSDPCommContext.reduce_scatter_states) until the next post-backward frees it
        # (reduce_scatter_max_input_buffers 1), an experts unit's over a group of one too (torch 2.13's
        # _fsdp_param_group.py post_backward keeps every foreach_reduce's input; measured on the CPU harness:
        # deepseek-v3 under ep 2, -1.98% with the experts' freed at once)
        if self.flat:
            self.held.append(rs_in)
        else:
            run.free(rs_in)
        if self.keep and not g.offload:
            self.outputs.append(out)
        else:
            run.free(out)  # added into the kept shard, or (offloaded) copied to the host's

    def at(self, kind: str, blk: int) -> None:
        nblocks = len(self.blocks)
        if kind == "pre" and EMB in self.units:
            self.unshard(EMB, hold=True)
        elif kind == "F" and 0 <= blk < nblocks and blk not in self.unsharded:
            self.unshard(blk, hold=True)
        elif kind == "mid" and HEAD in self.units:  # the head's unit: its all-gather frees the last block's output
            self.unshard(HEAD, hold=True)
        if kind in ("B", "post") and self.bwd is not None:
            self.post_backward(self.bwd)
            self.bwd = None
        if kind == "B" and 0 <= blk < nblocks:
            if blk not in self.unsharded:
                self.unshard(blk, hold=False)
            # the next unit in reverse post-forward order: the block's experts (their post-forward came before
            # the block's), else the block before
            self.prefetch(XOFF + blk if XOFF + blk in self.units else blk - 1)
            self.bwd = blk
        elif kind == "post" and EMB in self.units:
            if EMB not in self.unsharded:
                self.unshard(EMB, hold=False)
            self.bwd = EMB

    def forward_returned(self) -> None:
        """The root's _post_forward (the last all-gather result freed; the root resharded when it reshards after
        forward), then backward's first hook, the root's _pre_backward (the root unsharded again; the last block
        prefetched)."""
        if self.returned:
            return
        self.returned = True
        run = self.run
        for k in self.held:
            run.free(k)
        self.held.clear()
        if self.root_reshards and ROOT in self.unsharded:
            for k in self.unsharded.pop(ROOT):
                run.free(k)
            self.unshard(ROOT, hold=False)
        if self.blocks:
            self.prefetch(len(self.blocks) - 1)

    def experts_at(self, kind: str, blk: int) -> None:
        """The experts unit of block ``blk`` where the traced step marks its module (torch 2.13's
        _fsdp_state.py, _fsdp_param_group.py): its _pre_forward unshards it (the all-gather output kept, the
        previous one freed), its _post_forward reshards it (reshard_after_forward True); its pre-backward hook
        unshards it again (from the block's prefetch) and prefetches the block before; its post-backward reshards
        it and reduce-scatters its gradients. A recomputation in backward runs its _pre_forward and _post_forward
        again (the unit idle then): unsharded from the block's prefetch and resharded, its pre-backward then
        all-gathering anew. Non-reentrant checkpointing recomputes a block when its backward first unpacks a saved
        tensor, which can come after the experts' pre-backward (their state PRE_BACKWARD then: _pre_forward only
        makes sure they are unsharded, _post_forward leaves them), and stops once the saved tensors are back (a
        module it stops inside never runs its _post_forward: no "XRE"). With reshard_after_forward False (the
        block's, as torchtitan's apply_fsdp gives the experts under pipelining) the unit stays unsharded from its
        first forward on."""
        x = XOFF + blk
        if x not in self.units:
            return
        if kind == "XF":
            if x not in self.unsharded:  # kept from an earlier micro-batch (reshard_after_forward False)
                self.unshard(x, hold=True)
        elif kind == "XFE" or (kind == "XRE" and self.in_experts != blk):
            if self.reshard_after_forward:  # False (torchtitan under pipelining): kept to the reduce
                for k in self.unsharded.pop(x, []):
                    self.run.free(k)
        elif kind == "XR":
            if x not in self.unsharded:
                self.unshard(x, hold=False)
        elif kind == "XB":
            if x not in self.unsharded:
                self.unshard(x, hold=False)
            self.prefetch(blk - 1)
            self.in_experts = blk
        elif kind == "XBE":
            self.in_experts = None
            self.post_backward(x)

    def region(self, kind: str, blk: int) -> None:
        """Where a region of the traced step begins: the forward before it has ended."""
        if kind in EXPERT_KINDS:
            self.experts_at(kind, blk)
            return
        if self.forward is not None:
            self.on_forward_end(self.forward)
            self.forward = None
        if self.kind == "mid" and kind != "mid" and not self.returned:
            self.forward_returned()  # a step traced without its forward's end marked: at the latest here
        if self.kind == "mid" and HEAD in self.units and kind != "mid":
            self.bwd = HEAD  # the head's backward is over: its post-backward comes before the last block's
        self.kind = kind
        self.at(kind, blk)
        if kind == "F":
            self.forward = blk
        elif kind == "pre" and EMB in self.units:
            self.forward = EMB

    def on_forward_end(self, blk: int) -> None:
        if not self.reshard_after_forward or blk not in self.unsharded:
            return
        run, keys = self.run, self.unsharded.pop(blk)
        if self.group is None or not self.units[blk].post_forward:
            for k in keys:
                run.free(k)
            return
        shares = self.shares[blk] = []
        for k, n in zip(keys, self.units[blk].post_forward):  # each share cloned, then its parameter freed
            shares.append(run.alloc(n))
            run.free(k)


def why_not(s: Any) -> str | None:
    return None


def unit_tensors(inv: Any, s: Any) -> tuple[list[list[Any]], list[Any], list[Any] | None, list[Any] | None]:
    """The tensors of each fully_shard unit as --fsdp-wrap makes them: the blocks', the root's, and with
    block+embeddings the input embedding's and the final norm's with the head's (frameworks/fsdp2.py
    wrap_why_not: one untied embedding before the blocks).

    ``size:N`` and ``class:...`` take their units from model/wrap_units.py, grouped as the allocated peak groups
    them (ParamTensor.group): where no unit lies inside a block, the root alone (--fsdp-wrap none's timeline,
    the same figures as none); otherwise a block's units gathered together as the block, and the units above the
    blocks with the root (options.py says so beside the figure: an upper bound where a block holds several)."""
    from memplan.model import wrap_units
    from memplan.model.inventory import ROOT_BLOCK, ParamTensor

    wrap = s.torch.fsdp_wrap
    if wrap_units.policy_of(s) is not None:
        units = wrap_units.units_for(inv, s)
        if wrap_units.root_only(units):
            return [], list(units.tensors), None, None
        return ([[t for t in units.block_tensors(b.name) if t.group == b.name] for b in units.layer_blocks],
                [t for t in units.tensors if t.group == ROOT_BLOCK], None, None)
    if wrap == "none":
        return [], list(inv.tensors), None, None
    blocks = [list(inv.block_tensors(b.name)) for b in inv.layer_blocks]
    root = [t for t in inv.tensors if t.block == ROOT_BLOCK]
    if wrap != "block+embeddings":
        return blocks, root, None, None
    seen = False
    emb: list[ParamTensor] = []
    head: list[ParamTensor] = []
    for t in inv.tensors:
        seen = seen or t.block != ROOT_BLOCK
        if t.block == ROOT_BLOCK:
            (head if seen or t.tied_names else emb).append(t)
    return blocks, [], emb, head


def fsdp_group(ts: list[Any], position: dict[str, int], n: int, r: Any, cb: int, group_size: int = 0,
               cpu_chunk: bool = False, offload: bool = False, float8: frozenset[str] = frozenset()) -> FsdpGroup:
    """One fully_shard unit of tensors ``ts`` over n ranks, shards padded on dim 0 (``position``: each tensor's
    index in module order; ``r`` the recipe; ``cb`` bytes per unsharded element; ``group_size`` a
    reshard_after_forward group size, 0 for none)."""
    from memplan.layouts import dim_shard, shard_dim

    # each shard padded on the dim it is sharded on (0; 1 for experts over more ranks than they are)
    padded = [dim_shard(t, n) * n if t.shape and t.shape[0] else t.numel for t in ts]
    # foreach_reduce takes the parameters with a gradient (frozen under LoRA: none)
    trained = sum(p for t, p in zip(ts, padded) if t.trainable)
    # float8's all-gather (``float8``: the weights it gathers in float8, frameworks/fsdp2.py float8_gathered)
    eb = tuple(1 if t.name in float8 else cb for t in ts) if float8 & {t.name for t in ts} else ()
    return FsdpGroup(params=tuple(position[t.name] for t in ts),
                     shard=tuple(p // n * r.param_bytes for p in padded),
                     unsharded=tuple(t.numel * (eb[i] if eb else cb) for i, t in enumerate(ts)),
                     cast=r.param_bytes != cb,
                     reduce_in=trained * r.reduced_grad_bytes,
                     reduce_out=trained // n * r.reduced_grad_bytes,
                     post_forward=tuple(p // group_size * (eb[i] if eb else cb) for i, p in enumerate(padded))
                     if group_size else (), elem_bytes=eb,
                     chunk_tmp=r.grad_bytes * max((t.numel for t in ts if t.trainable), default=0)
                     if cpu_chunk else 0,
                     offload=offload, padded=tuple(padded), unshard_bytes=cb,
                     dim1=n > 1 and any(shard_dim(t, n) == 1 for t in ts))


def replay(inv: Any, s: Any, config: AllocatorConfig) -> tuple[str, dict[str, Allocator]]:
    """fully_shard on each block, then the root (whatever no block holds), shards padded on dim 0."""
    from memplan.frameworks.common import Job
    from memplan.frameworks.fsdp2 import (
        MODEL,
        reshard_after_forward,
        root_reshards,
        unshard_bytes,
    )
    from memplan.layouts import tensor_group
    from memplan.precision import float8_gathered
    from memplan.replay import replay_job
    from memplan.settings import shard_group_size

    n, r = shard_group_size(s), s.recipe
    cb = unshard_bytes(r)  # the all-gather's and the unsharded parameters' dtype (not autocast's compute dtype)
    numels: list[tuple[int, int]] = []  # (position in module order, shard elements)
    position = {t.name: i for i, t in enumerate(inv.tensors)}

    raf = reshard_after_forward(Job.of(inv, s, MODEL))
    group_size = raf if not isinstance(raf, bool) else 0  # a reshard_after_forward group size
    cpu_chunk = s.cluster.device == "cpu" and r.grad_bytes != r.reduced_grad_bytes
    f8 = float8_gathered(inv, s)

    def group(ts: list[Any]) -> FsdpGroup:
        g = fsdp_group(ts, position, n, r, cb, group_size, cpu_chunk, bool(s.torch.cpu_offload), f8)
        # the optimizer, model.parameters() that train (frozen under LoRA: no gradient, no state)
        numels.extend((position[t.name], p // n) for t, p in zip(ts, g.padded) if t.trainable)
        return g
    blocks, root, emb, head = unit_tensors(inv, s)
    # expert parallelism: each block's routed experts (ParamTensor.shard_split) are an FSDP2 unit of their own,
    # fully_shard-ed over the expert-FSDP ranks before the block (transformers' apply_fully_sharded_data_parallelism,
    # torchtitan's apply_fsdp), resharded after forward; the block's unit holds the rest
    experts: dict[int, FsdpGroup] = {}
    ew = 0
    for i, ts in enumerate(blocks):
        xs = [t for t in ts if t.shard_split > 1]
        if not xs:
            continue
        ew = tensor_group(xs[0], n)  # the expert-FSDP group (layouts: the engine's own)
        g = fsdp_group(xs, position, ew, r, cb, 0, cpu_chunk, False, f8)
        numels.extend((position[t.name], p // ew) for t, p in zip(xs, g.padded) if t.trainable)
        experts[i] = g
        blocks[i] = [t for t in ts if t.shard_split == 1]
    emb_g = group(emb) if emb else None
    groups = [group(ts) for ts in blocks]
    head_g = group(head) if head else None
    groups.append(group(root))
    # the optimizer is made on model.parameters(): its states come in module order, whatever the units
    job = replay_job(inv, s, [k for _, k in sorted(numels)])
    return "FSDP2", {"": replay_fsdp2(job, tuple(groups), n, raf, config, emb=emb_g, head=head_g,
                                      root_reshards=root_reshards(s, raf) and not (emb or head),
                                      experts=experts, experts_world=ew)}
