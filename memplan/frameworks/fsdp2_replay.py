"""The reserved-peak replay of FSDP2 (fully_shard's setup, unshard, all-gather, copy-out and reduce-scatter order)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.allocator import Allocator, AllocatorConfig
from memplan.replay import MAX_STEPS, ReplayJob, Run, build_model, micro_step, optimizer_step


@dataclass(frozen=True)
class FsdpGroup:
    """One fully_shard unit (a block, or the root with what no block holds), per rank."""

    params: tuple[int, ...]  #: its parameters' positions in module order
    shard: tuple[int, ...]  #: bytes of each sharded parameter (dim 0 padded to the shard count), stored dtype
    unsharded: tuple[int, ...]  #: bytes of each unsharded parameter in the compute dtype
    cast: bool  #: the all-gather input is a cast of the shard (MixedPrecisionPolicy param_dtype differs)
    reduce_in: int  #: the reduce-scatter input: every padded gradient in the reduce dtype
    reduce_out: int  #: its output: this rank's sharded gradients, which the .grad views keep


#: the allocator's stream for FSDP2's reduce-scatter outputs (its own pool; any id but the default's)
RS_STREAM = 2
AG_STREAM = 1


def _unshard(run: Run, g: FsdpGroup, world: int) -> list[Any]:
    """FSDPParamGroup.unshard + wait_for_unshard with one rank: no all-gather (unshard() records an empty
    result); each unsharded parameter is made from its shard when the block runs, each cast (when the compute
    dtype differs) freed after the next one is made (measured: ../shared/gpu/traces/fsdp_full_rc)."""
    keys = []
    prev = None
    for n in g.unsharded:
        cast = run.alloc(n) if g.cast else None
        if prev is not None:
            run.free(prev)
        keys.append(run.alloc(n))
        prev = cast
    if prev is not None:
        run.free(prev)
    return keys


def _all_gather(run: Run, g: FsdpGroup, world: int) -> Any:
    """FSDPParamGroup.unshard with more ranks (_fsdp_collectives.py foreach_all_gather): every shard cast on the
    copy-in stream into one flat all-gather output; the output is returned, the casts freed."""
    casts = [run.alloc(-(-n // world), stream=AG_STREAM) for n in g.unsharded] if g.cast else []
    flat = run.alloc(sum(-(-n // world) for n in g.unsharded) * world, stream=AG_STREAM)
    for k in casts:
        run.free(k)
    return flat


def _copy_out(run: Run, g: FsdpGroup) -> list[Any]:
    """wait_for_unshard's foreach_all_gather_copy_out: each unsharded parameter, on the default stream."""
    return [run.alloc(n) for n in g.unsharded]


def replay_fsdp2(job: ReplayJob, groups: tuple[FsdpGroup, ...], world: int, reshard_after_forward: bool,
                 config: AllocatorConfig | None = None) -> Allocator:
    """FSDP2 (torch/distributed/fsdp/_fully_shard): fully_shard on each block then the root. Setup replaces each
    parameter by its padded shard, a group's new shards made before its old parameters go (_fsdp_param.py
    _init_sharded_param). In a step the root unshards at the forward's start and stays unsharded; each block
    unshards before its forward and, resharding after forward, again before its backward; after a block's
    backward (post_backward) its gradients go into one reduce-scatter input in the reduce dtype, then the
    unsharded gradients are freed and the output (on the reduce-scatter stream) is allocated, whose views
    are the sharded .grad until zero_grad; the optimizer steps the shards. ``groups``: the blocks in order,
    the root last."""
    run = Run(config or AllocatorConfig())
    if world == 1:
        # one rank: built on the device, then each group's shards made and its parameters freed (measured)
        built = build_model(run, job)
        for g in groups:
            for n in g.shard:
                run.alloc(n)
            for i in g.params:
                run.free(built[i])
    else:
        # more ranks: the full model never fits one device at the sizes FSDP is for; it is built on the meta
        # device, sharded, then materialized shard by shard (to_empty + init, torchtitan's recipe)
        for g in groups:
            for n in g.shard:
                run.alloc(n)
    blocks, root = groups[:-1], groups[-1]
    states: list[Any] = []
    for n in range(MAX_STEPS):
        before = run.a.peak_reserved
        outputs: list[Any] = []
        for m in range(job.grad_accum):
            ids = run.alloc(job.input_bytes)
            _fsdp_micro_step(run, job, (n, m), blocks, root, world, reshard_after_forward, outputs,
                             first=n == 0 and m == 0, keep=m == 0)
            run.free(ids)
        optimizer_step(run, job, n == 0, states)
        for k in outputs:
            run.free(k)
        run.end_step()
        if n >= 1 and run.a.peak_reserved == before:
            break
    return run.a


def _fsdp_micro_step(run: Run, job: ReplayJob, n: Any, blocks: tuple[FsdpGroup, ...], root: FsdpGroup, world: int,
                     reshard_after_forward: bool, outputs: list[Any], first: bool, keep: bool) -> None:
    """One micro-step under FSDP2; the reduce-scatter outputs go to ``outputs`` (``keep``), or, in a later
    micro-step, are added into the sharded gradients and freed. With more than one rank (frameworks/fsdp2.py's
    notes, each checked on the harness): in forward a block's all-gather output is held until the next block's
    copy-out (FSDPCommContext.all_gather_state), the last one to the root's post-forward; in backward the root's
    pre-backward prefetches the last block, a block's pre-backward copies out of its prefetched output (then
    frees it) and prefetches the next; a post-backward frees the previous reduce-scatter input
    (reduce_scatter_max_input_buffers = 1)."""
    st = _MicroStep(run, job, blocks, root, world, reshard_after_forward, outputs, first, keep)
    st.unshard(-1, hold=True)
    # each gradient kept, by block, for its post-backward
    micro_step(run, job, n, keep_grads=True, at=st.region,
               on_grad=lambda _size, key, blk: st.grads_of.setdefault(blk, []).append(key))
    st.post_backward(-1)
    for k in st.held:
        run.free(k)


class _MicroStep:
    """FSDP2's state through one micro-step: what is unsharded, prefetched, held, and each block's gradients."""

    def __init__(self, run: Run, job: ReplayJob, blocks: tuple[FsdpGroup, ...], root: FsdpGroup, world: int,
                 reshard_after_forward: bool, outputs: list[Any], first: bool, keep: bool) -> None:
        self.run, self.job, self.blocks, self.root, self.world = run, job, blocks, root, world
        self.reshard_after_forward, self.outputs, self.first, self.keep = reshard_after_forward, outputs, first, keep
        self.flat = world > 1
        self.unsharded: dict[int, list[Any]] = {}
        self.gathered: dict[int, Any] = {}  # prefetched all-gather outputs, by block
        self.held: list[Any] = []  # forward: the last all-gather output; backward: the last reduce-scatter input
        self.grads_of: dict[int, list[Any]] = {}
        self.bwd: int | None = None
        self.forward: int | None = None  #: the block whose forward runs (it ends where the next region begins)

    def unshard(self, i: int, hold: bool) -> None:
        run = self.run
        g = self.root if i < 0 else self.blocks[i]
        if not self.flat:
            self.unsharded[i] = _unshard(run, g, self.world)
            return
        out = self.gathered.pop(i, None) or _all_gather(run, g, self.world)
        self.unsharded[i] = _copy_out(run, g)
        if hold:  # forward: free the previous output now, keep this one
            for k in self.held:
                run.free(k)
            self.held[:] = [out]
        else:
            run.free(out)

    def prefetch(self, i: int) -> None:
        if self.flat and 0 <= i < len(self.blocks) and i not in self.unsharded and i not in self.gathered:
            self.gathered[i] = _all_gather(self.run, self.blocks[i], self.world)

    def post_backward(self, i: int) -> None:
        run = self.run
        g = self.root if i < 0 else self.blocks[i]
        for k in self.unsharded.pop(i, []):  # reshard
            run.free(k)
        for k in self.held:
            run.free(k)
        self.held.clear()
        rs_in = run.alloc(g.reduce_in)
        for k in self.grads_of.pop(i, []):
            run.free(k)
        out = run.alloc(g.reduce_out, stream=RS_STREAM)
        if self.flat:
            self.held.append(rs_in)
        else:
            run.free(rs_in)
        if self.keep:
            self.outputs.append(out)
        else:
            run.free(out)

    def at(self, kind: str, blk: int) -> None:
        nblocks = len(self.blocks)
        if kind == "F" and blk < nblocks and blk not in self.unsharded:
            self.unshard(blk, hold=True)
        elif kind == "mid":
            for k in self.held:  # the root's post-forward
                self.run.free(k)
            self.held.clear()
            self.prefetch(nblocks - 1)
        if kind in ("B", "post") and self.bwd is not None:
            self.post_backward(self.bwd)
            self.bwd = None
        if kind == "B" and blk < nblocks:
            if blk not in self.unsharded:
                self.unshard(blk, hold=False)
            self.prefetch(blk - 1)
            self.bwd = blk

    def region(self, kind: str, blk: int) -> None:
        """Where a region of the traced step begins: the forward before it has ended."""
        if self.forward is not None:
            self.on_forward_end(self.forward)
            self.forward = None
        self.at(kind, blk)
        if kind == "F":
            self.forward = blk

    def on_forward_end(self, blk: int) -> None:
        if self.reshard_after_forward and blk in self.unsharded:
            for k in self.unsharded.pop(blk):
                self.run.free(k)


def why_not(s: Any) -> str | None:
    if not s.strategy.shard_params or s.torch.cpu_offload:
        return "FSDP2 without sharding or with CPU offload not modelled yet"
    return None


def replay(inv: Any, s: Any, config: AllocatorConfig) -> tuple[str, dict[str, Allocator]]:
    """fully_shard on each block, then the root (whatever no block holds), shards padded on dim 0."""
    from memplan.frameworks.common import Job
    from memplan.frameworks.fsdp2 import MODEL, reshard_after_forward
    from memplan.replay import replay_job
    from memplan.settings import shard_group_size
    from memplan.units import ceil_div

    n, r = shard_group_size(s), s.recipe
    groups = []
    numels = []
    position = {t.name: i for i, t in enumerate(inv.tensors)}
    for block in [b.name for b in inv.layer_blocks] + [inv.blocks[0].name]:
        ts = inv.block_tensors(block)
        padded = [ceil_div(t.shape[0], n) * (t.numel // t.shape[0]) * n if t.shape and t.shape[0] else t.numel
                  for t in ts]
        numels += [p // n for p in padded]
        groups.append(FsdpGroup(params=tuple(position[t.name] for t in ts),
                                shard=tuple(p // n * r.param_bytes for p in padded),
                                unsharded=tuple(t.numel * r.compute_bytes for t in ts),
                                cast=r.param_bytes != r.compute_bytes,
                                reduce_in=sum(padded) * r.reduced_grad_bytes,
                                reduce_out=sum(padded) // n * r.reduced_grad_bytes))
    job = replay_job(inv, s, numels)
    raf = reshard_after_forward(Job.of(inv, s, MODEL))
    return "FSDP2", {"": replay_fsdp2(job, tuple(groups), n, bool(raf), config)}
