"""The reserved-peak replay of DeepSpeed ZeRO-3 (partitions, defragmentation, sub-groups, gathers)."""

from __future__ import annotations

from typing import Any

from memplan.allocator import Allocator, AllocatorConfig
from memplan.replay import MAX_STEPS, ReplayJob, Run, build_model, micro_step


def replay_zero3(job: ReplayJob, world: int, partitions: tuple[int, ...], sub_groups: tuple[int, ...],
                 blocks: tuple[int, ...], bucket: int, half: int = 2,
                 config: AllocatorConfig | None = None, offload: bool = False,
                 host_params: HostParams | None = None,
                 roots: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
                 trainable: tuple[bool, ...] | None = None) -> Allocator:
    """DeepSpeed ZeRO-3 (deepspeed/runtime/zero/stage3.py, partition_parameters.py) with a fused Adam, per rank:
    ``partitions`` (each parameter's partition, elements, module order), ``sub_groups`` (the optimizer's
    sub-groups, elements), ``blocks`` (each block's gathered elements, with more than one rank), ``bucket``
    (reduce_bucket_size).

    Setup: with one rank the model is built on the device and each parameter replaced by its bit16 partition
    (as the H100 stream zero3_offload shows); with more, zero.Init makes the partitions directly. The optimizer
    defragments them into one flat buffer (_create_fp16_partitions_with_defragmentation: through the host, with an
    empty_cache between, zero/utils.py defragment), makes each sub-group's
    fp32 partition (.clone().float()) and a zero fp32 gradient it drops (initialize_optimizer_states; the Adam
    states come at the first step), then the ipg bucket buffer and the flat gradient partition buffer (grad_partitions_flat_buffer),
    A step: with one rank nothing is gathered (NoGatherHandle: the parameter points at its
    partition); with more, each block is gathered into one coalesced buffer before its forward (the next one
    prefetched) and freed after it, and again in backward. Each gradient goes into the bucket in its hook and is
    freed; full buckets are reduced into the flat gradient buffer. The optimizer, sub-group by sub-group,
    flattens the gradients (bit16), converts them to fp32, steps and frees them; the norm reads each gradient in
    fp64 first.

    ``offload`` (offload_optimizer to the host): the fp32 partitions, their gradients and the flat gradient buffer
    are on the host (made there: a blocking copy converts on the host), the optimizer steps there; each bucket's
    reduce copies every gradient partition to the host through the device (see ipg_bucket).
    Measured: ../shared/gpu/traces/zero3_offload.

    ``host_params`` (offload_param, with the optimizer offloaded): the partitions live on the host too; each
    parameter is fetched to the device when its module runs and released as the coordinator decides (HostParams).
    Measured: bench/gpu/traces/q05_z3offpo."""
    hosted = host_params if host_params is not None and host_params.on_host else None
    run = _setup(job, world, partitions, sub_groups, bucket, half, config, offload, hosted, trainable)
    trained = partitions if trainable is None else tuple(p for p, t in zip(partitions, trainable) if t)
    for n in range(MAX_STEPS):
        before = run.a.peak_reserved
        for m in range(job.grad_accum):
            ids = run.alloc(job.input_bytes)
            if host_params is not None:
                at, end = host_params.micro_step(run, complete=n > 0 or m > 0)
            else:
                at, gathered = _gathers(run, world, blocks, half, job, n == 0 and m == 0, roots)
            on_grad, flush = ipg_bucket(run, world, bucket, half, offload)
            micro_step(run, job, keep_grads=False, at=at, on_grad=on_grad)
            flush()  # independent_gradient_partition_epilogue: the bucket's rest
            if host_params is not None:
                end()
            else:
                for k in gathered.values():
                    run.free(k)
                gathered.clear()
            run.free(ids)
        if host_params is not None:  # step(): _partition_all_parameters releases the persistent ones too
            host_params.release_persistent(run)
        if not offload:
            _optimizer_step(run, job, trained, sub_groups, half, n == 0)
        if host_params is not None:
            host_params.regather_persistent(run)
            host_params.invalidate_secondary(run)
        run.end_step()
        if n >= 1 and run.a.peak_reserved == before:
            break
    return run.a


def _setup(job: ReplayJob, world: int, partitions: tuple[int, ...], sub_groups: tuple[int, ...], bucket: int,
           half: int, config: AllocatorConfig | None, offload: bool = False,
           host_params: HostParams | None = None, trainable: tuple[bool, ...] | None = None) -> Run:
    """The partitions made, defragmented, the fp32 sub-group partitions, the bucket and the flat gradient buffer
    (with the optimizer offloaded, only the flat bit16 buffer and the bucket are on the device; with the
    parameters offloaded too, the bucket alone). ``trainable`` (LoRA, module order): every parameter is
    partitioned (zero.Init), but the optimizer's groups, defragmented into the flat buffer, the fp32 partitions,
    the flat gradient buffer and the gradient hooks are the trained parameters' only; a frozen partition keeps its
    own storage."""
    run = Run(config or AllocatorConfig(), job.buffers)
    trains = trainable or (True,) * len(partitions)
    total = sum(p for p, t in zip(partitions, trains) if t)
    if job.quantized or job.packed:
        # a 4-bit base (QLoRA): transformers does not build a quantized model under zero.Init (modeling_utils
        # get_init_context: zero.Init only when not quantized); it loads it whole onto the device, each weight
        # quantized from its bf16 copy (replay.build_model), and deepspeed.initialize partitions it there
        params = build_model(run, job)[:len(partitions)]
        parts = []
        for k, p in zip(params, partitions):
            parts.append(run.alloc(p * half))
            run.free(k)
        if host_params is not None:
            # offload_param: each partition then goes to the host (_partition_param, remote_device cpu), frozen
            # ones too
            for k in parts:
                run.free(k)
            parts = []
    elif world == 1:
        keys = []
        for n, alias in job.build:
            keys.append(run.alloc(n))
        # tied aliases were built and freed with the model (_build); here the partitions replace the parameters
        params = [k for k, (_, alias) in zip(keys, job.build) if not alias]
        for k, (_, alias) in zip(keys, job.build):
            if alias:
                run.free(k)
        parts = []
        for k, p in zip(params, partitions):
            parts.append(run.alloc(p * half))
            run.free(k)
    elif host_params is not None:
        parts = []  # zero.Init with offload_param: each partition made on the host (remote_device cpu)
    else:
        parts = [run.alloc(p * half) for p in partitions]
    # _create_fp16_partitions_with_defragmentation -> zero/utils.py defragment: each partition copied to one
    # host buffer and freed, empty_cache, then the flat buffer back on the device
    for k, t in zip(parts, trains):
        if t:
            run.free(k)
    if host_params is not None and offload:
        # offload_param: the partitions went to the host (Init's _partition_param: remote_device cpu, pinned);
        # "if not self.offload_param" guards the defragmentation, so no empty_cache and no device flat buffer
        # (measured: q05_z3offpo reserves no segment back before the bucket)
        run.alloc(bucket * half)  # the ipg bucket buffer
        host_params.hook_gathers(run, trainable)
        return run
    if host_params is None:
        run.empty_cache()
        run.alloc(total * half)  # fp16_partitioned_groups_flat; the partitions are views of it
    if offload:
        run.alloc(bucket * half)  # the ipg bucket buffer
        _hook_gathers(run, job, half, trains)
        return run
    # _create_fp32_partitions: ``converted = flat.to(device, dtype=fp32)``, then its ``.clone()`` kept; the local
    # ``converted`` lets the previous sub-group's copy go only when it is rebound, the last at the return. With
    # offload_param and the optimizer on the device (stage3.py: self.device is the accelerator unless the optimizer
    # is offloaded) the flat groups are the host's pinned partitions (_create_param_groups_fp16_flat_cpu_memory):
    # the same device copies, converted on the host first (a blocking copy to the device converts on the source)
    converted = None
    for g in sub_groups:
        new = run.alloc(g * 4)
        if converted is not None:
            run.free(converted)
        converted = new
        run.alloc(g * 4)
    if converted is not None:
        run.free(converted)
    # initialize_optimizer_states: one zero fp32 gradient of the largest sub-group, narrowed for each and dropped
    # (the fused Adam makes its states at the first real step: measured, step 1's peak)
    if sub_groups:
        run.free(run.alloc(max(sub_groups) * 4))
    run.alloc(bucket * half)  # the ipg bucket buffer
    run.alloc(total * half)  # grad_partitions_flat_buffer
    if host_params is not None:
        host_params.hook_gathers(run, trainable)
    else:
        _hook_gathers(run, job, half, trains)
    return run


def _hook_gathers(run: Run, job: ReplayJob, half: int, trainable: tuple[bool, ...] | None = None) -> None:
    """create_reduce_and_remove_grad_hooks (stage3.py): each parameter, in module order, is gathered whole
    (``param.all_gather()``: "the hook must be created in un-partitioned parameter") and partitioned again.
    Measured on the H100 (bench/gpu/traces/l8b_z3, olmoe_z3; ../shared/gpu/traces/zero3_offload): one transient
    of each parameter's full size after the flat gradient buffer; only those that require grad get a hook."""
    params = [n for n, alias in job.build if not alias]
    for n, t in zip(params, trainable or (True,) * len(params)):
        if t:
            run.free(run.alloc(n // 4 * half))  # built in fp32: n // 4 elements


#: the stream DeepSpeed reduces and partitions gradients on (reduce_and_partition_stream): its own pool
REDUCE_STREAM = 1
#: the coordinator's all-gather stream (PartitionedParameterCoordinator.__allgather_stream): its own pool
FETCH_STREAM = 2


class HostParams:
    """ZeRO-3 with offload_param (ZeRO-Infinity on the host): every partition lives in pinned host memory, so a
    module's parameters are copied to the device when its hooks fetch them and freed when the coordinator
    releases them (deepspeed/runtime/zero/partitioned_param_coordinator.py, DeepSpeed 0.19.8).

    - a fetch runs on the coordinator's all-gather stream (``with get_accelerator().stream(self.__allgather_stream)``
      in __all_gather_params_), so its blocks come from that stream's pool. At one rank all_gather_coalesced
      takes _no_gather_coalesced: ``param.data = param.ds_tensor.data.to(device)``, one device copy of each
      parameter; with more, partition_parameters.py _all_gather_dtype: each partition copied to the device
      (``p.ds_tensor.to(device)``), torch.cat into one flat buffer of the group's padded partitions x ranks
      (a single parameter: _all_gather_sequential, the flat buffer is its own), which the first wait copies
      every member out of and frees once every member is waited on;
    - the first micro-step has no complete trace: each module's parameters are fetched before it runs and all
      released after it; from the second on, the coordinator prefetches along the recorded trace and keeps what
      is used again within stage3_max_reuse_distance (frameworks/zero3.py _Coordinator, the same rules the
      allocated peak uses). Parameters under stage3_param_persistence_threshold stay where they are (a few KiB).
    - the traced step's regions are blocks: a region's modules are fetched where it begins and released where it
      ends (a block's parameters alive together; DeepSpeed frees each module's after it).

    Measured on the H100 (bench/gpu/traces/q05_z3offpo): the first step fetches module by module; every later
    step fetches the whole model (494M elements, under stage3_max_live_parameters) during the first block's
    forward and releases each block's at the end of its backward."""

    def __init__(self, inv: Any, s: Any, world: int, half: int, on_host: bool = True) -> None:
        from memplan.frameworks.zero3 import _Coordinator
        from memplan.model.inventory import ROOT_BLOCK

        #: the partitions live on the host (offload_param); False: on the device, where the same coordinator
        #: fetches (all-gathers) and releases each module's parameters, without the host-to-device copies
        self.on_host = on_host
        ds = s.ds
        self.args = (inv, world, ds.prefetch_bucket_size, ds.max_live_parameters, ds.max_reuse_distance,
                     ds.param_persistence_threshold, None, s.z3_leaves)
        self.world, self.half = world, half
        c = _Coordinator(*self.args)
        self.trace, self.numel, self.persist = c.trace, c.numel, c.persist
        index = {b.name: i for i, b in enumerate(inv.layer_blocks)}
        nf = c.nf
        first = next((k for k in range(nf) if c.block_of[k] != ROOT_BLOCK), nf)
        #: the trace's modules by the traced step's region they run in: (kind, block) -> module indices
        self.regions: dict[tuple[str, int], list[int]] = {}
        for k in range(2 * nf):
            f = k if k < nf else 2 * nf - 1 - k
            blk = c.block_of[f]
            if blk == ROOT_BLOCK or blk not in index:
                key = ("mid" if f >= first else "pre" if k < nf else "post", -1)
            else:
                key = ("F" if k < nf else "B", index[blk])
            self.regions.setdefault(key, []).append(k)
        #: each parameter's elements and its partition's (padded to the ranks), module order
        self.params = [t.numel for t in inv.tensors]
        #: ZeRO++ hpZ (zero_hpz_partition_size > 1): each parameter's secondary partition over that many ranks,
        #: made when the parameter is first partitioned again after a forward gather (partition_parameters.py
        #: _partition -> _partition_param_sec: ds_secondary_tensor, on remote_device: the host under
        #: offload_param, where it has no device bytes) and kept to the step's end (stage3.py _post_step:
        #: invalidate_secondary_tensor); every later gather of it reads the secondary, over the hpZ group
        #: (all_gather_coalesced: ``use_secondary_tensor``), its host copy brought to the device first
        self.hpz = ds.hpz_partition_size if world > 1 else 1
        self.secondary: dict[int, Any] = {}
        self.nf = nf
        #: persistent parameters (numel <= stage3_param_persistence_threshold, parameter_offload.py
        #: mark_persistent_parameters) gathered whole where their module first runs and never released
        #: (release_sub_module skips ds_persist); their device tensors, kept across micro-steps and steps
        self.kept: dict[int, Any | None] = {}

    def release_persistent(self, run: Run) -> None:
        """stage3.py step -> _partition_all_parameters -> release_and_reset_all: every parameter partitioned,
        the persistent ones too (__release_param does not check ds_persist): their whole tensors freed."""
        for p, key in self.kept.items():
            if key is not None:
                run.free(key)
                self.kept[p] = None

    def invalidate_secondary(self, run: Run) -> None:
        """stage3.py _post_step, after the persistent parameters' gather: invalidate_secondary_tensor drops every
        secondary partition (made again by the next forward's releases)."""
        for key in self.secondary.values():
            if key is not None:
                run.free(key)
        self.secondary.clear()

    def regather_persistent(self, run: Run) -> None:
        """stage3.py _post_step: ``persistent_parameters[0].all_gather(persistent_parameters)`` after every step
        (partition_parameters.py _allgather_params_coalesced, one parameter: _allgather_params_sequential): a
        flat buffer of its padded partitions x ranks for every persistent parameter, each parameter's data a view
        of its buffer (its partition is on the device even under offload_param: _partition_param puts a
        ds_persist partition on local_device)."""
        w, h = self.world, self.half
        for p in self.kept:
            self.kept[p] = run.alloc(-(-self.numel[p] // w) * w * h)

    def hook_gathers(self, run: Run, trainable: tuple[bool, ...] | None = None) -> None:
        """create_reduce_and_remove_grad_hooks gathers each parameter once (``param.all_gather()`` ->
        _allgather_params_sequential): a flat buffer of its padded size and the partition's device copy
        (``param.ds_tensor.to(device)``: a copy, the partition being on the host), the copy dropped after the
        collective, the buffer when the parameter is partitioned again (measured: two transients each). Only the
        optimizer's parameters get a hook (it walks fp16_groups, the groups of parameters that require grad:
        LoRA's adapters, ``trainable``); a frozen partition stays on the host untouched."""
        w, h = self.world, self.half
        for numel, t in zip(self.params, trainable or (True,) * len(self.params)):
            if not t:
                continue
            part = -(-numel // w)
            flat = run.alloc(part * w * h)
            run.free(run.alloc(part * h))
            run.free(flat)

    def micro_step(self, run: Run, complete: bool) -> tuple[Any, Any]:
        """The traced step's region callback for one micro-step, and what releases the rest at its end."""
        c = _Fetching(run, self, complete)
        open_: list[int] = []

        def at(kind: str, blk: int) -> None:
            for k in open_:
                c.release(k)
            open_[:] = self.regions.get((kind, blk), [])
            for k in open_:
                c.fetch(k)

        def end() -> None:
            for k in open_:
                c.release(k)
            open_.clear()
            c.release_all()
        return at, end


class _Fetching:
    """One micro-step's fetches and releases (HostParams), emitted into the replay."""

    def __init__(self, run: Run, hp: HostParams, complete: bool) -> None:
        from memplan.frameworks.zero3 import _Coordinator

        self.run, self.hp, self.complete = run, hp, complete
        self.keys: dict[int, Any] = {}  # parameter -> its device tensor
        self.flats: dict[int, Any] = {}  # coalesced group -> its flat buffer (more than one rank)
        self.pending: dict[int, list[int]] = {}  # coalesced group -> members not yet copied out
        self.group_of: dict[int, int] = {}
        self.c = _Coordinator(*hp.args) if complete else None
        if self.c is not None:
            self.c.gather = self._gather  # type: ignore[method-assign]

    def _gather(self, ps: list[int], gid: int) -> None:
        c, run, hp = self.c, self.run, self.hp
        if c is not None:
            c.avail.update(ps)
            c.n_avail += sum(hp.numel[p] for p in ps)
        w, h = hp.world, hp.half
        if w == 1:
            for p in ps:
                self.keys[p] = run.alloc(hp.numel[p] * h, stream=FETCH_STREAM)
            return
        parts = [-(-hp.numel[p] // w) for p in ps]
        flat = run.alloc(sum(parts) * w * h, stream=FETCH_STREAM)
        # each partition copied to the device first where it lives on the host (``p.ds_tensor.to(device)`` is
        # the partition itself on the device); with hpZ's secondary partitions (the group's first parameter has
        # one: the gather runs over the hpZ group into a flat buffer of the same size), the secondary's copy
        sec = hp.hpz > 1 and min(ps) in hp.secondary
        sizes = [-(-hp.numel[p] // hp.hpz) for p in ps] if sec else parts
        copies = [run.alloc(n * h, stream=FETCH_STREAM) for n in sizes] if hp.on_host else []
        for k in copies:
            run.free(k)
        if len(ps) == 1:
            self.keys[ps[0]] = flat
            return
        self.flats[gid] = flat
        self.pending[gid] = list(ps)
        for p in ps:
            self.group_of[p] = gid

    def _wait(self, params: list[int]) -> None:
        """AllGatherCoalescedHandle.wait: the group's members copied out of its flat buffer at the first wait
        (on the fetch stream), the buffer freed with it."""
        for p in params:
            gid = self.group_of.get(p)
            if gid is None or gid not in self.flats:
                continue
            for q in self.pending.pop(gid):
                self.keys[q] = self.run.alloc(self.hp.numel[q] * self.hp.half, stream=FETCH_STREAM)
                self.group_of.pop(q, None)
            self.run.free(self.flats.pop(gid))

    def fetch(self, k: int) -> None:
        params = self.hp.trace[k]
        c, hp = self.c, self.hp
        if c is None:  # no complete trace yet: the module's own parameters, nothing prefetched
            # a persistent parameter not gathered yet is NOT_AVAILABLE, so fetched with the module's others
            todo = [p for p in dict.fromkeys(params) if (not hp.persist[p] or p not in hp.kept)
                    and p not in self.keys and p not in self.group_of]
            if todo:
                self._gather(todo, 2 * k)
            self._wait(params)
            self._keep(params)
            return
        todo = [p for p in dict.fromkeys(params) if (not c.persist[p] or p not in hp.kept) and p not in c.avail]
        if todo:
            c.gather(todo, 2 * k)
        self._wait(params)
        self._keep(params)
        c.prefetch_after(k, params)

    def _keep(self, params: list[int]) -> None:
        """Persistent parameters just gathered move to the kept set: no release frees them."""
        hp = self.hp
        for p in params:
            if hp.persist[p] and p in self.keys and p not in hp.kept:
                hp.kept[p] = self.keys.pop(p)

    def release(self, k: int) -> None:
        hp = self.hp
        if hp.hpz > 1:  # hpZ: a release makes each missing secondary partition (_partition -> _partition_param_sec)
            for p in dict.fromkeys(hp.trace[k]):
                if p not in hp.secondary and not hp.persist[p]:
                    hp.secondary[p] = None if hp.on_host else self.run.alloc(-(-hp.numel[p] // hp.hpz) * hp.half)
        c = self.c
        if c is None:
            for p in dict.fromkeys(self.hp.trace[k]):
                self._free(p)
            return
        c.release_after(k, self.hp.trace[k])
        for p in [p for p in list(self.keys) + list(self.group_of) if p not in c.avail]:
            self._free(p)

    def _free(self, p: int) -> None:
        key = self.keys.pop(p, None)
        if key is not None:
            self.run.free(key)
        gid = self.group_of.pop(p, None)
        if gid is not None and gid in self.pending:
            self.pending[gid].remove(p)
            if not self.pending[gid]:
                del self.pending[gid]
                self.run.free(self.flats.pop(gid))

    def release_all(self) -> None:
        """stage3.py step: every parameter partitioned again (release_and_reset_all)."""
        for p in list(self.keys) + list(self.group_of):
            self._free(p)


#: _constant_buffered_norm2's chunk (stage3.py: the norm of a gradient partition, in fp64, 250M elements at a time)
NORM_CHUNK = 250_000_000


def ipg_bucket(run: Run, world: int, bucket: int, half: int, offload: bool = False) -> tuple[Any, Any]:
    """The gradient hooks' bucket (stage3.py reduce_independent_p_g_buckets_and_remove_grads): a gradient that
    would take the bucket past reduce_bucket_size reduces it first (__reduce_and_partition_ipg_grads ->
    __avg_scatter_grads -> comm/coalesced_collectives.py reduce_scatter_coalesced, on the reduce stream), which
    torch.cat's the bucket's gradients, each padded to a multiple of the ranks, into one buffer (none where the
    bucket holds one gradient that needs no padding), freed once the partitions are copied out. Returns the
    hook (on_grad) and the flush.

    With the optimizer offloaded, partition_grads then takes the bucket's gradients in ds_id (module) order, each
    on the reduce stream: its partition copied to the host's flat gradient buffer and back to the device
    (``grad_buffer.to(device)``: a bit16 copy, dropped when the loop takes the next), its norm in fp64 chunks
    (_constant_buffered_norm2) and an fp32 copy for the host's fp32 gradient (_offload_grad_partition_at_boundary)."""
    state: dict[str, Any] = {"elements": 0, "padded": 0, "count": 0, "exact": True, "parts": [], "apart": []}

    def flush() -> None:
        cat = None
        if state["count"] > 1 or (state["count"] == 1 and not state["exact"]):
            cat = run.alloc(state["padded"] * half, stream=REDUCE_STREAM)
        if offload:
            copy = None
            for part in reversed(state["parts"]):
                if copy is not None:
                    run.free(copy)
                copy = run.alloc(part * half, stream=REDUCE_STREAM)
                for start in range(0, part, NORM_CHUNK):
                    run.free(run.alloc(min(NORM_CHUNK, part - start) * 8, stream=REDUCE_STREAM))
                if half != 4:
                    run.free(run.alloc(part * 4, stream=REDUCE_STREAM))
            if copy is not None:
                run.free(copy)
        if cat is not None:
            run.free(cat)
        for k in state["apart"]:  # partition_grads done: the gradient released (param.grad = None)
            run.free(k)
        state.update(elements=0, padded=0, count=0, exact=True, parts=[], apart=[])

    def on_grad(nbytes: int, key: Any = None, *_: Any) -> bool:
        """A gradient's hook; True where the gradient stays in its own storage until its bucket is reduced
        (__add_grad_to_ipg_bucket moves it into the contiguous bucket only when it fits: one larger than
        reduce_bucket_size is kept where it is)."""
        numel = nbytes // half
        if state["elements"] + numel > bucket and state["elements"] > 0:
            flush()
        state["elements"] += numel
        state["padded"] += -(-numel // world) * world
        state["count"] += 1
        state["exact"] = numel % world == 0
        state["parts"].append(-(-numel // world))
        if numel > bucket and key is not None:
            state["apart"].append(key)
            return True
        return False
    return on_grad, flush


def _gathers(run: Run, world: int, blocks: tuple[int, ...], half: int, job: ReplayJob,
             first: bool, roots: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
             ) -> tuple[Any, dict[Any, Any]]:
    """The traced step's region callback: each block gathered (the next one prefetched) before its forward and its
    backward, released after; the root's modules around them, each parameter gathered alone
    (partition_parameters.py _all_gather_sequential: a buffer of its padded partitions, the parameter a view of it):
    the input embedding's in the step's first region ("pre") and again for its backward ("post"), the final
    norm's and the head's (a tied head: the embedding's weight) where the head, the loss and their backward run
    ("mid"); each released when the next region begins."""
    gathered: dict[Any, Any] = {}
    embedding, head = roots

    def gather(i: int) -> None:
        if world > 1 and 0 <= i < len(blocks) and i not in gathered:
            gathered[i] = run.alloc(blocks[i] * half)

    def release(i: Any) -> None:
        k = gathered.pop(i, None)
        if k is not None:
            run.free(k)

    def gather_root(name: str, numels: tuple[int, ...]) -> None:
        if world > 1:
            for j, numel in enumerate(numels):
                gathered[(name, j)] = run.alloc(-(-numel // world) * world * half)
            state["root"] = [(name, j) for j in range(len(numels))]

    state: dict[str, Any] = {"f": None, "b": None, "root": []}

    def at(kind: str, blk: int) -> None:
        for key in ("f", "b"):
            if state[key] is not None:
                release(state[key])
                state[key] = None
        for k in state["root"]:
            release(k)
        state["root"] = []
        if kind in ("pre", "post"):
            gather_root(kind, embedding)
        elif kind == "mid":
            gather_root(kind, head)
        if kind == "F" and blk >= 0:
            gather(blk)
            gather(blk + 1)  # prefetched
            state["f"] = blk
        elif kind == "B" and blk >= 0:
            gather(blk)
            gather(blk - 1)
            state["b"] = blk
    return at, gathered


def _optimizer_step(run: Run, job: ReplayJob, partitions: tuple[int, ...], sub_groups: tuple[int, ...], half: int,
                    first: bool) -> None:
    """The norm over each gradient partition in fp64, then sub-group by sub-group: flatten, fp32 copy, states at
    the first step, the step."""
    for numel in partitions:  # the norm: each gradient partition in fp64, one after another
        run.free(run.alloc(numel * 8))
    for i, g in enumerate(sub_groups):
        copy = run.alloc(g * half)  # flatten(averaged_gradients)
        fp32 = run.alloc(g * 4)
        run.free(copy)
        if first:  # the optimizer's states, made at its first step
            if i == 0:
                job.first_states(run, [])
            for b in job.state_allocs(g):
                run.alloc(b)
        run.free(fp32)  # after the sub-group's step


def replay(inv: Any, s: Any, config: AllocatorConfig) -> tuple[str, dict[str, Allocator]]:
    from memplan.replay import replay_job
    from memplan.settings import shard_group_size
    from memplan.units import ceil_div

    from memplan.frameworks.zero3 import sub_groups

    from memplan.model.inventory import ROOT_BLOCK

    n = shard_group_size(s)
    parts = tuple(ceil_div(t.numel, n) for t in inv.tensors)
    trained = [p for p, t in zip(parts, inv.tensors) if t.trainable]  # the optimizer's (LoRA: the adapters)
    groups = sub_groups(trained, s.ds.sub_group_size)
    blocks = tuple(b.numel for b in inv.layer_blocks)
    # the root's parameters by where they run: the input embedding at the step's start (and its backward at the
    # end), the rest (final norm, head; a tied head is the embedding's weight again) around the loss
    root = [t for t in inv.tensors if t.block == ROOT_BLOCK]
    embedding = tuple(t.numel for t in root if t.category == "embedding")
    head = tuple(t.numel for t in root if t.category != "embedding") + \
        tuple(t.numel for t in root if t.category == "embedding" and t.tied_names)
    job = replay_job(inv, s, [sum(trained)])
    offload = bool(s.ds.offload_optimizer)
    host = HostParams(inv, s, n, s.recipe.param_bytes) if s.ds.offload_param else \
        HostParams(inv, s, n, s.recipe.param_bytes, on_host=False) if n > 1 else None
    return "ZeRO-3" + (" Offload" if offload else "") + (" (parameters too)" if s.ds.offload_param else ""), {
        "": replay_zero3(job, n, parts, tuple(groups), blocks, s.ds.reduce_bucket_size, s.recipe.param_bytes, config,
                         offload, host, (embedding, head),
                         tuple(t.trainable for t in inv.tensors) if inv.frozen else None)}


def why_not(s: Any) -> str | None:
    """Every ZeRO-3 setup memplan accepts is replayed."""
    return None
