"""The reserved-peak replay of DDP (the allocation order of DistributedDataParallel and its Reducer)."""

from __future__ import annotations

from typing import Any

from memplan.allocator import Allocator, AllocatorConfig
from memplan.replay import (MAX_STEPS, MiB, ReplayJob, Run, bucket_assignment, build_model, micro_step, ready_order,
                            optimizer_step)


#: DDP's broadcast of the module states at construction: buffers of 250 MiB (distributed.py
#: _sync_module_states(..., broadcast_bucket_size=int(250 * 1024 * 1024)))
DDP_BROADCAST_BUCKET = 250 * MiB
#: c10d's _DEFAULT_FIRST_BUCKET_BYTES: the first bucket of a rebuilt Reducer
DDP_FIRST_BUCKET = 1 * MiB


def _broadcast_coalesced(run: Run, sizes: list[int], bucket: int) -> None:
    """c10d broadcast_coalesced (torch/csrc/distributed/c10d/comm.cpp): buckets of ``bucket`` bytes, each
    flattened into one buffer (a bucket of one tensor is a view of it), at most two in flight."""
    in_flight: list[Any] = []
    for idx in bucket_assignment(sizes, [bucket]):
        if len(in_flight) >= 2:
            k = in_flight.pop(0)
            if k is not None:
                run.free(k)
        in_flight.append(run.alloc(sum(sizes[i] for i in idx)) if len(idx) > 1 else None)
    for k in in_flight:
        if k is not None:
            run.free(k)


def replay_ddp(job: ReplayJob, config: AllocatorConfig | None = None, release: str = "pre",
               reducer: bool = True, trainable: tuple[bool, ...] | None = None,
               bucket_limits: tuple[int, ...] = (DDP_FIRST_BUCKET, 25 * MiB), find_unused: bool = False,
               as_view: bool = False) -> Allocator:
    """DistributedDataParallel (torch/nn/parallel/distributed.py, c10d reducer.cpp) with a torch.optim optimizer:
    the module states broadcast in 250 MiB buffers; the Reducer's first bucket assignment is one bucket for all
    parameters (no find_unused_parameters: bucket_size_limits = [sys.maxsize]), rebuilt at the second
    forward (_rebuild_buckets: the old buckets freed, then one buffer per bucket of the order the gradients
    became ready, limits [1 MiB, 25 MiB]); gradients stay until zero_grad(set_to_none=True).

    ``release``: where the old buckets' memory returns. The Reducer drops them at the rebuild ("pre"), but the
    last all-reduce of step 1 also holds its bucket (ProcessGroupNCCL stashes a collective's tensors until its
    watchdog sees the work complete, torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp), so in a short step the
    memory comes back only in step 2's backward ("grad": at its first gradient). Measured on the H100: 24 of 32
    DDP runs released at the rebuild, 8 in backward (their step 2 peaks by the buckets' size), and one
    configuration (gpt2) did each in one of two runs.

    ``trainable`` (LoRA: which parameters require grad, module order): the broadcast takes every module state
    (_sync_module_states: named_parameters, frozen or not), the Reducer's buckets only the parameters that
    require grad (_build_params_for_reducer), and the optimizer steps those (job.numels).

    ``find_unused`` (parameters no loss reads: find_unused_parameters=True): the first bucket assignment is by
    size already (compute_bucket_size_limits: the limits [1 MiB, bucket_cap_mb], parameters in module order, the
    buckets handed to the Reducer reversed, which allocates them in that order) and never rebuilt
    (reducer.h should_rebuild_buckets), and the Reducer keeps an int32 per parameter on the device
    (initialize_local_used_map).

    ``as_view`` (gradient_as_bucket_view=True): each gradient autograd makes is copied into its bucket view by the
    Reducer's hook (a post-hook of the parameter's AccumulateGrad) and the parameter's .grad pointed at that view,
    so the gradient made goes at once (reducer.cpp mark_variable_ready_dense: ``at::mul_out(bucket_view, grad,
    ...)``, then ``grad = bucket_view``); a later micro-step adds into the view in place. zero_grad(set_to_none=True)
    drops the views, and the next step's gradients are made and copied again. The buckets are all the gradient
    memory there is (memplan/frameworks/ddp.py counts them so)."""
    run = Run(config or AllocatorConfig(), job.buffers)
    build_model(run, job)
    sizes = list(job.converted or [n for n, alias in job.build if not alias])
    buckets: list[Any] = []
    if reducer:  # without DDP (one GPU, plain PyTorch): no broadcast, no buckets
        _broadcast_coalesced(run, sizes, DDP_BROADCAST_BUCKET)
        mask = trainable or [True] * len(sizes)
        if find_unused:
            buckets = unused_buckets(run, [n for n, grad in zip(sizes, mask) if grad], bucket_limits)
        else:
            buckets = [run.alloc(sum(n for n, grad in zip(sizes, mask) if grad))]
    old: list[Any] = []
    states: list[Any] = []
    first_grads: list[tuple[Any, int]] = []
    forwards = 0
    for n in range(MAX_STEPS):
        before = run.a.peak_reserved
        grads: list[tuple[Any, int]] = []
        for m in range(job.grad_accum):
            ids = run.alloc(job.input_bytes)
            if forwards == 1 and reducer and not find_unused:
                old = buckets
                if release == "pre":
                    # Reducer::initialize_buckets clears buckets_ before it allocates the new ones: with nothing
                    # else holding them the old buckets are free for the new (recorded: ../shared/gpu/traces/
                    # ddp_amp frees its 4,714 MiB bucket, then allocates the rebuilt ones)
                    for k in old:
                        run.free(k)
                    old = []
                # the Reducer's rebuilt order is the order the gradients were ready (autograd_hook ->
                # rebuilt_params_), which a Linear's bias, summed after its weight's matmul, reaches first
                buckets = rebuilt_buckets(run, first_grads, bucket_limits)
            rebuilt = forwards == 1

            def at(kind: str, blk: int, rebuilt: bool = rebuilt) -> None:
                if rebuilt and kind == release:
                    for k in old:
                        run.free(k)
                    old.clear()
            made: list[tuple[Any, int]] = []

            def on_grad(size: int, key: Any, _blk: int, made: list[tuple[Any, int]] = made) -> bool:
                at("grad", 0)
                made.append((key, size))
                return False
            # later micro-steps add into the kept gradients (AccumulateGrad in place; theirs die at once); as bucket
            # views, every micro-step's die at once (copied into the buckets)
            grads += micro_step(run, job, keep_grads=m == 0 and not (as_view and reducer), at=at, on_grad=on_grad)
            at("end", 0)
            if forwards == 0:
                first_grads = made
            forwards += 1
            run.free(ids)
        if _end_step(run, job, n, states, grads, before, settled_after=2):
            break
    return run.a


def unused_buckets(run: Run, sizes: list[int], limits: tuple[int, ...]) -> list[Any]:
    """find_unused_parameters=True: the Reducer's buckets by size from the start (compute_bucket_size_limits, the
    buckets handed over reversed, allocated in that order), then its int32 map of the parameters used
    (initialize_local_used_map: local_used_map_dev_)."""
    out = [run.alloc(sum(sizes[i] for i in idx)) for idx in reversed(bucket_assignment(sizes, list(limits)))]
    out.append(run.alloc(4 * len(sizes)))
    return out


def rebuilt_buckets(run: Run, first: list[tuple[Any, int]], limits: tuple[int, ...]) -> list[Any]:
    """Reducer::rebuild_buckets: one buffer per bucket of the order the first hooked backward's gradients were ready
    (``first``: (key, bytes) in the order made; replay.ready_order)."""
    ready = [size for _, size in ready_order(first, run.late)]
    return [run.alloc(sum(ready[i] for i in idx)) for idx in bucket_assignment(ready, list(limits))]


def _end_step(run: Run, job: ReplayJob, n: int, states: list[Any], grads: list[tuple[Any, int]], before: int,
              settled_after: int) -> bool:
    """The optimizer's step, zero_grad(set_to_none=True) (the kept gradients freed, last made first), the step
    recorded; True once the reserved peak has stopped growing from step ``settled_after`` on."""
    optimizer_step(run, job, n == 0, states)
    for k, _ in reversed(grads):
        run.free(k)
    run.end_step()
    return n >= settled_after and run.a.peak_reserved == before


def replay_horovod(job: ReplayJob, config: AllocatorConfig | None, fusion: int, compression: bool) -> Allocator:
    """hvd.DistributedOptimizer over a torch.optim optimizer (horovod/torch/optimizer.py), backward_passes_per_step
    set to the gradient accumulation: the model built and its states broadcast in place
    (hvd.broadcast_parameters); in the last micro-step's backward each gradient's hook starts its all-reduce
    (_allreduce_grad_async), the first one making Horovod's fusion buffer, HOROVOD_FUSION_THRESHOLD bytes kept
    for the run (horovod/common/fusion_buffer_manager.cc InitializeBuffer, torch/adapter_v2.cc); with
    compression=Compression.fp16 the hook all-reduces an fp16 copy of the gradient (compression.py
    FP16Compressor.compress). optimizer.step() first synchronize()s: per handle in hook order, the decompressed
    fp32 result is made and set_ into the gradient, whose old storage goes; the fp16 copies live in _handles until
    it is cleared, after the loop. Gradients stay until zero_grad(set_to_none=True)."""
    run = Run(config or AllocatorConfig(), job.buffers)
    build_model(run, job)
    fused: list[Any] = []
    states: list[Any] = []
    bytes_per = job.recipe.grad_bytes if job.recipe is not None else 4
    for n in range(MAX_STEPS):
        before = run.a.peak_reserved
        grads: list[tuple[Any, int]] = []
        copies: list[tuple[Any, int]] = []  # (fp16 copy, index of the kept gradient it was made from)
        for m in range(job.grad_accum):
            ids = run.alloc(job.input_bytes)
            last, seen = m == job.grad_accum - 1, [0]

            def on_grad(size: int, _key: Any, _blk: int, last: bool = last, seen: list[int] = seen) -> bool:
                if last:
                    if not fused:
                        fused.append(run.alloc(fusion))
                    if compression:
                        copies.append((run.alloc(size // bytes_per * 2), seen[0]))
                seen[0] += 1
                return False
            grads += micro_step(run, job, keep_grads=m == 0, on_grad=on_grad)
            run.free(ids)
        for _, i in copies:  # synchronize(): decompress, set_ into p.grad
            key, size = grads[i]
            new = run.alloc(size)
            run.free(key)
            grads[i] = (new, size)
        for k, _ in copies:  # self._handles.clear()
            run.free(k)
        if _end_step(run, job, n, states, grads, before, settled_after=1):
            break
    return run.a


def why_not(s: Any) -> str | None:
    return None


def replay(inv: Any, s: Any, config: AllocatorConfig) -> tuple[str, dict[str, Allocator]]:
    """The two release orders DDP's first buckets can take (replay_ddp ``release``)."""
    from memplan.replay import replay_job

    if s.strategy.shard_optimizer:
        # ZeroRedundancyOptimizer: the worst rank's optimizer steps its whole parameters, largest first
        # (torch/distributed/optim/zero_redundancy_optimizer.py _partition_parameters: sorted by numel, each to
        # the rank with the fewest elements so far; layouts.GREEDY_WHOLE), so its states are made in that order;
        # step() then broadcasts each rank's parameters in place (_sync_params, parameters_as_bucket_view False)
        from memplan.layouts import layout_sizes
        from memplan.settings import shard_group_size

        lay = layout_sizes(inv, s.strategy.layout, shard_group_size(s), 0)
        job = replay_job(inv, s, [n for _, n in lay.shard_shapes], [shape for shape, _ in lay.shard_shapes])
    else:
        steps = [t for t in inv.tensors if t.trainable]  # all of them but under LoRA
        job = replay_job(inv, s, [t.numel for t in steps], [t.shape for t in steps])
    # the Reducer's buckets: every parameter that requires grad, those no loss reads too (ParamTensor.unused)
    trainable = tuple(t.trainable or t.unused for t in inv.tensors) if inv.frozen else None
    if s.strategy.fusion_buffer and s.cluster.gpus > 1:
        return "Horovod", {"": replay_horovod(job, config, s.horovod.fusion_threshold,
                                              s.horovod.compression == "fp16")}
    if not s.strategy.ddp_buckets:
        return "PyTorch", {"": replay_ddp(job, config, reducer=False)}
    limits = bucket_limits(s.torch.bucket_cap_mb, s.torch.bucket_cap_default)
    view = s.torch.gradient_as_bucket_view
    name = "DDP, gradients as bucket views" if view else "DDP"
    if inv.unused_params:  # find_unused_parameters=True: the buckets by size from the start, never rebuilt
        return name, {"find_unused_parameters: buckets by size, kept": replay_ddp(
            job, config, "pre", trainable=trainable, bucket_limits=limits, find_unused=True, as_view=view)}
    return name, {"buckets released at the rebuild": replay_ddp(job, config, "pre", trainable=trainable,
                                                                bucket_limits=limits, as_view=view),
                  "buckets held into step 2's backward": replay_ddp(job, config, "grad", trainable=trainable,
                                                                    bucket_limits=limits, as_view=view)}


def bucket_limits(cap_mb: int, default: bool) -> tuple[int, ...]:
    """The rebuilt Reducer's bucket limits (torch/nn/parallel/distributed.py _BucketCapacityConfig.create and
    compute_bucket_size_limits): a 1 MiB first bucket, then bucket_cap_mb, while the cap is DDP's default; a cap
    given makes every bucket that large."""
    cap = int(cap_mb * MiB)
    return (DDP_FIRST_BUCKET, cap) if default and DDP_FIRST_BUCKET < cap else (cap,)
