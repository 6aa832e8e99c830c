"""The reserved-peak replay of FSDP1: FullyShardedDataParallel with use_orig_params=False, one FlatParameter per
wrapped unit (torch 2.13: torch/distributed/fsdp/_flat_param.py, _runtime_utils.py, _init_utils.py), each
allocation on the stream FSDP makes it on.

- Setup (FullyShardedDataParallel.__init__ with device_id, the model built on the host, as Accelerate and the HF
  Trainer run it): the auto-wrap policy wraps the units bottom-up, the blocks in module order, the root last; each
  unit's parameters are moved to the device one by one (_init_utils.py _move_module_to_device), concatenated into
  the unit's flat parameter (FlatParamHandle.flatten_tensors: torch.cat), whose shard is cloned
  (FlatParamHandle._get_shard: chunk(world)[rank].clone(); then padded) before the flat storage is resized to 0
  (FlatParamHandle.shard); the moved parameters die when the unit's init returns (the views replace them).
  NO_SHARD (FSDP1's choice at world 1 too: _init_utils.py "FSDP is switching to use NO_SHARD") keeps the flat
  parameter whole.
- Lazy init (the root's first forward, _share_state_and_init_handle_attrs, root first then the other units in
  module order): FlatParamHandle.init_flat_param_attributes allocates and frees at once, on the default stream,
  the low-precision shard (_mp_shard), the padded unsharded parameter in the unshard dtype and, with a
  MixedPrecision param_dtype, a full-precision one (_full_prec_full_param_padded).
- Unshard (_runtime_utils.py _unshard): with a param_dtype, the shard is cast into _mp_shard on the pre-unshard
  stream (pre_unshard -> _use_low_precision_shard); the padded unsharded flat parameter is allocated on the
  unshard stream (_alloc_padded_unsharded_flat_param) and all-gathered into; _mp_shard is then freed
  (post_unshard). NO_SHARD with a param_dtype: _mp_shard is the whole parameter in that dtype, freed at every
  reshard (post_reshard), made again at the next unshard; without one, nothing is allocated.
- Forward: the root unshards first and is never resharded after forward (_post_forward_reshard); FULL_SHARD
  frees each block's unsharded parameter at its post-forward, SHARD_GRAD_OP keeps it to its backward.
- Backward (BackwardPrefetch.BACKWARD_PRE, the default): the root's pre-backward (the loss's gradient) prefetches
  the last block; each block's pre-backward unshards it unless prefetched and prefetches the one before
  (_exec_order_utils.py get_handle_to_backward_prefetch). A unit's parameters are split() views of its flat
  parameter, so their gradients wait in the split's input buffer until the unit's backward is done; the split's
  backward concatenates them into the flat gradient (default stream), they are freed, and the post-backward hook
  (_post_backward_hook) reshards, casts the flat gradient to reduce_dtype on the post-backward stream,
  pads it to the shard count (_get_reduce_scatter_tensors: F.pad), allocates the new shard (torch.empty_like) and
  reduce-scatters; the new shard is kept as _saved_grad_shard (or added into it, then freed); the cast, the
  padded copy and the autograd gradient die as the hook returns. NO_SHARD all-reduces the cast flat gradient in
  place and keeps it. The root's views take gradients from the head's backward to the embedding's; the root is
  reduced last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.allocator import Allocator, AllocatorConfig
from memplan.replay import MAX_STEPS, ReplayJob, Run, micro_step, optimizer_step

#: the allocator's streams (pool keys): FSDPState's _unshard_stream, _post_backward_stream, _pre_unshard_stream
UNSHARD, POST_BACKWARD, PRE_UNSHARD = 1, 2, 3
#: the root's key beside the blocks' positions
ROOT = -1


@dataclass(frozen=True)
class FlatUnit:
    """One FlatParameter, per rank."""

    params: tuple[int, ...]  #: its parameters' positions in module order
    param_bytes: tuple[int, ...]  #: each parameter's bytes as moved to the device (the stored dtype)
    numel: int  #: the flat parameter's elements (unpadded)
    shard: int  #: elements of each rank's padded shard (the whole flat parameter under NO_SHARD)
    #: the FlatParameters among them that require grad, (elements, shard elements) each: the unit itself where
    #: nothing is frozen; under LoRA (PEFT's units) a block's adapters, its frozen FlatParameter none
    trained: tuple[tuple[int, int], ...] | None = None

    @property
    def grad_numel(self) -> int:
        return self.numel if self.trained is None else sum(n for n, _ in self.trained)

    @property
    def grad_shard(self) -> int:
        return self.shard if self.trained is None else sum(sh for _, sh in self.trained)


@dataclass(frozen=True)
class Fsdp1Setup:
    """What decides FSDP1's allocations, per rank."""

    world: int  #: the shard group (1: NO_SHARD)
    stored: int  #: bytes per element of the sharded flat parameter
    unshard: int  #: bytes per element of the unsharded parameter and of autograd's gradient
    reduce: int  #: bytes per element of the reduced gradient (MixedPrecision.reduce_dtype)
    reshard_after_forward: bool  #: FULL_SHARD (or HYBRID_SHARD) True, SHARD_GRAD_OP False
    #: CPUOffload(offload_params=True): the flat parameters (and _cpu_grad) live on the host; each unshard
    #: copies the shard in, the reduced shards go to the host at backward's end, the optimizer steps there
    offload: bool = False

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def low_precision(self) -> bool:  #: a MixedPrecision param_dtype other than the stored dtype
        return self.unshard != self.stored


def _setup(run: Run, units: list[FlatUnit], fs: Fsdp1Setup) -> None:
    """FullyShardedDataParallel.__init__, unit by unit (module docstring); with CPU offload the module stays on the
    host (flattened and sharded there)."""
    if fs.offload:
        return
    for u in units:
        moved = [run.alloc(b) for b in u.param_bytes]
        flat = run.alloc(u.numel * fs.stored)
        if fs.sharded:
            run.alloc(u.shard * fs.stored)
            run.free(flat)
        for k in moved:
            run.free(k)


def _lazy_init(run: Run, units: list[FlatUnit], fs: Fsdp1Setup) -> None:
    """init_flat_param_attributes for each unit, the root first (the root is last in ``units``)."""
    for u in [units[-1], *units[:-1]]:
        sizes = []
        if fs.low_precision:
            sizes.append(u.shard * fs.unshard)
        if fs.sharded:
            sizes.append(u.shard * fs.world * fs.unshard)
            if fs.low_precision:
                sizes.append(u.shard * fs.world * fs.stored)
        for n in sizes:
            run.free(run.alloc(n))


def replay_fsdp1(job: ReplayJob, blocks: list[FlatUnit], root: FlatUnit, fs: Fsdp1Setup,
                 config: AllocatorConfig | None = None) -> Allocator:
    """The steps of FSDP1 over ``blocks`` (the units inside the decoder blocks, in order) and ``root`` (what no
    block holds; under --fsdp-wrap none every parameter), from setup to the steady step."""
    run = Run(config or AllocatorConfig(), job.buffers)
    units = [*blocks, root]
    _setup(run, units, fs)
    states: list[Any] = []
    for n in range(MAX_STEPS):
        before = run.a.peak_reserved
        saved: dict[int, Any] = {}  # each unit's _saved_grad_shard (NO_SHARD: its reduced flat gradient)
        for m in range(job.grad_accum):
            ids = run.alloc(job.input_bytes)
            _MicroStep(run, job, blocks, root, fs, saved, first=n == 0 and m == 0).go()
            run.free(ids)
            if fs.offload:
                # each backward's final callback (prepare_gradient_for_optim): .grad = _cpu_grad, the device's
                # reduced gradients dropped (_saved_grad_shard; NO_SHARD's flat gradient)
                for k in saved.values():
                    run.free(k)
                saved.clear()
        if not fs.offload:  # offloaded: the optimizer steps on the host
            optimizer_step(run, job, n == 0, states)
            for k in saved.values():  # optimizer.zero_grad(set_to_none=True)
                run.free(k)
        run.end_step()
        if n >= 1 and run.a.peak_reserved == before:
            break
    return run.a


class _MicroStep:
    """FSDP1's state through one micro-step: what is unsharded, each unit's view gradients, the pending
    post-backward."""

    def __init__(self, run: Run, job: ReplayJob, blocks: list[FlatUnit], root: FlatUnit, fs: Fsdp1Setup,
                 saved: dict[int, Any], first: bool) -> None:
        self.run, self.job, self.fs, self.saved, self.first = run, job, fs, saved, first
        self.units: dict[int, FlatUnit] = dict(enumerate(blocks))
        self.units[ROOT] = root
        self.nblocks = len(blocks)
        self.unsharded: dict[int, Any] = {}  # unit -> its unsharded flat parameter (NO_SHARD: _mp_shard)
        self.device_shard: dict[int, Any] = {}  # CPU offload without a param_dtype: the shard copied in
        self.grads_of: dict[int, list[Any]] = {}
        self.pending: int | None = None  # the unit whose backward runs (its post-backward comes next)
        self.forward: int | None = None  # the block whose forward runs
        self.returned = False

    def go(self) -> None:
        if self.first:
            _lazy_init(self.run, self.list_units(), self.fs)
        self.unshard(ROOT)
        micro_step(self.run, self.job, keep_grads=True, at=self.region, on_grad=self.on_grad,
                   on_forward_end=self.forward_returned)
        if not self.returned:
            self.forward_returned()
        if self.pending is not None:
            self.post_backward(self.pending)
            self.pending = None
        self.post_backward(ROOT)

    def list_units(self) -> list[FlatUnit]:
        return [self.units[i] for i in range(self.nblocks)] + [self.units[ROOT]]

    def on_grad(self, _size: int, key: Any, blk: int) -> bool:
        unit = blk if 0 <= blk < self.nblocks else ROOT
        self.grads_of.setdefault(unit, []).append(key)
        return True

    def unshard(self, i: int) -> None:
        """_unshard: nothing where the unit is unsharded already (SHARD_GRAD_OP after forward, the root)."""
        if i in self.unsharded:
            return
        run, fs, u = self.run, self.fs, self.units[i]
        if not u.numel:
            return
        if not fs.sharded:
            if fs.low_precision:  # NO_SHARD: _mp_shard is the unsharded parameter
                self.unsharded[i] = run.alloc(u.numel * fs.unshard, stream=PRE_UNSHARD)
                if fs.offload:  # filled from the host's shard: _local_shard.to(device), a temporary
                    run.free(run.alloc(u.numel * fs.stored, stream=PRE_UNSHARD))
            elif fs.offload:  # flat_param_to(device): the whole flat parameter on the device until reshard
                self.unsharded[i] = run.alloc(u.numel * fs.stored, stream=PRE_UNSHARD)
            return
        mp = run.alloc(u.shard * fs.unshard, stream=PRE_UNSHARD) if fs.low_precision else None
        if fs.offload:
            if mp is not None:  # _use_low_precision_shard: _local_shard.to(device) copied into _mp_shard
                run.free(run.alloc(u.shard * fs.stored, stream=PRE_UNSHARD))
            else:  # flat_param_to(device): the shard on the device, the all-gather's input, until reshard
                self.device_shard[i] = run.alloc(u.shard * fs.stored, stream=PRE_UNSHARD)
        self.unsharded[i] = run.alloc(u.shard * fs.world * fs.unshard, stream=UNSHARD)
        if mp is not None:
            run.free(mp)

    def reshard(self, i: int, free: bool) -> None:
        """_reshard: the unsharded parameter freed when ``free`` (a sharded strategy); NO_SHARD's _mp_shard
        freed whatever ``free`` says (post_reshard)."""
        if i in self.unsharded and (free or not self.fs.sharded):
            self.run.free(self.unsharded.pop(i))
        if i in self.device_shard:  # _use_sharded_flat_param: flat_param.data = the host's _local_shard
            self.run.free(self.device_shard.pop(i))

    def post_backward(self, i: int) -> None:
        """The unit's trainable FlatParameters' post-backward hooks (counted together, as one of their summed
        sizes); a frozen one is resharded only (_register_post_backward_reshard_only_hook)."""
        run, fs, u = self.run, self.fs, self.units[i]
        views = self.grads_of.pop(i, [])
        if not u.numel:
            return
        if not u.grad_numel:
            for k in views:
                run.free(k)
            self.reshard(i, free=True)
            return
        numel, shard = u.grad_numel, u.grad_shard
        flat = run.alloc(numel * fs.unshard)  # the split's backward: torch.cat of the view gradients
        for k in views:
            run.free(k)
        held = self.saved.get(i)
        if held is not None and not fs.sharded:
            # NO_SHARD, a later micro-step: AccumulateGrad adds into the kept flat gradient in place
            run.free(flat)
            self.reshard(i, free=False)
            return
        self.reshard(i, free=True)
        cast = run.alloc(numel * fs.reduce, stream=POST_BACKWARD) if fs.reduce != fs.unshard else None
        if not fs.sharded:
            if cast is not None:
                run.free(flat)
                self.saved[i] = cast
            else:
                self.saved[i] = flat
            return
        padded = shard * fs.world
        pad = run.alloc(padded * fs.reduce, stream=POST_BACKWARD) if padded != numel else None
        new = run.alloc(shard * fs.reduce, stream=POST_BACKWARD)
        if held is None:
            self.saved[i] = new
        if cast is not None:
            run.free(cast)
        if pad is not None:
            run.free(pad)
        if held is not None:
            run.free(new)  # added into _saved_grad_shard
        run.free(flat)

    def region(self, kind: str, blk: int) -> None:
        """Where a region of the traced step begins: the previous block's forward or backward has ended."""
        if self.forward is not None:
            self.reshard(self.forward, free=self.fs.reshard_after_forward)
            self.forward = None
        if kind in ("B", "post") and not self.returned:
            self.forward_returned()
        if kind in ("B", "post") and self.pending is not None:
            self.post_backward(self.pending)
            self.pending = None
        if kind == "F" and 0 <= blk < self.nblocks:
            self.unshard(blk)
            self.forward = blk
        elif kind == "B" and 0 <= blk < self.nblocks:
            self.unshard(blk)
            if blk >= 1:
                # BACKWARD_PRE's prefetch (under PEFT's units FSDP1 prefetches it later, at the block's first
                # adapter's backward: frameworks/fsdp1.py, an upper bound)
                self.unshard(blk - 1)
            self.pending = blk

    def forward_returned(self) -> None:
        """The root's post-forward (resharded without freeing: NO_SHARD's _mp_shard is freed), then the root's
        pre-backward: unsharded again where it was freed, and the last block prefetched."""
        if self.returned:
            return
        self.returned = True
        self.reshard(ROOT, free=False)
        self.unshard(ROOT)
        if self.nblocks:
            self.unshard(self.nblocks - 1)


def _flats(ts: list[Any]) -> list[int]:
    """Elements of each FlatParameter among ``ts`` (ParamTensor.unit, else the block: PEFT's units put each adapter
    in its own)."""
    out: dict[str, int] = {}
    for t in ts:
        out[t.unit or t.block] = out.get(t.unit or t.block, 0) + t.numel
    return list(out.values())


def why_not(s: Any) -> str | None:
    if s.torch.fsdp_wrap == "block+embeddings":
        return "--fsdp-wrap block+embeddings is torchtitan's FSDP2 layout"
    return None


def replay(inv: Any, s: Any, config: AllocatorConfig) -> tuple[str, dict[str, Allocator]]:
    """FullyShardedDataParallel(model, auto_wrap_policy=..., use_orig_params=False, device_id=...), the model
    built on the host (frameworks/fsdp2_replay.py unit_tensors: the same units as the allocated peak's)."""
    from memplan.frameworks.fsdp1 import reshards_after_forward
    from memplan.frameworks.fsdp2_replay import unit_tensors
    from memplan.replay import replay_job
    from memplan.settings import shard_group_size
    from memplan.units import ceil_div

    world = shard_group_size(s) if s.strategy.shard_params else 1
    rc = s.recipe
    position = {t.name: i for i, t in enumerate(inv.tensors)}

    def unit(ts: list[Any]) -> FlatUnit:
        numel = sum(t.numel for t in ts)
        # each FlatParameter that requires grad, where some are frozen (a uniform one: options.py refuses a mix)
        trained = tuple((x, ceil_div(x, world)) for x in _flats([t for t in ts if t.trainable])) \
            if inv.frozen else None
        return FlatUnit(params=tuple(position[t.name] for t in ts),
                        param_bytes=tuple(t.numel * rc.param_bytes for t in ts), numel=numel,
                        shard=sum(ceil_div(x, world) for x in _flats(ts)), trained=trained)
    block_ts, root_ts, _, _ = unit_tensors(inv, s)
    blocks = [unit(ts) for ts in block_ts]
    root = unit(root_ts)
    fs = Fsdp1Setup(world=world, stored=rc.param_bytes, unshard=rc.grad_bytes, reduce=rc.reduced_grad_bytes,
                    reshard_after_forward=world > 1 and reshards_after_forward(s), offload=bool(s.torch.cpu_offload))
    # fsdp.parameters(): the root's flat parameter first (registered on the wrapped model), then the blocks'; the
    # optimizer steps those that require grad
    job = replay_job(inv, s, [sh for u in (root, *blocks) for sh in
                              ([u.shard] if u.trained is None else [sh for _, sh in u.trained]) if sh])
    return "FSDP1", {"": replay_fsdp1(job, blocks, root, fs, config)}
