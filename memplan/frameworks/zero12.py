"""DeepSpeed stages 0, 1 and 2 (deepspeed/runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer; stage 0's
FP16_Optimizer / FP16_UnfusedOptimizer, deepspeed/runtime/fp16), DeepSpeed 0.19.8: the ipg reduce bucket, the
gradients in the rank's partition, ZeRO-1's reduce after backward, the step's flatten, stage 0's all-reduce chunks
and fp32 gradient copies, and ZeRO-Offload's host buffers."""

from __future__ import annotations

from dataclasses import replace

from memplan.frameworks.common import (LOSS, FrameworkModel, Grads, Job, OffloadedGrads, StepIn,
                                       unreduced_grad_moments)
from memplan.model.inventory import ParamInventory
from memplan.settings import Settings, optimizer_impl
from memplan.timeline import NO_HOOK_TRANSIENT, BufferMoment, BufferTimeline, HookTransient, Moment
from memplan.units import ceil_div


def grads_at_end(job: Job) -> int:
    """Stages 0 and 1 keep every gradient whole to backward's end; ZeRO-2 keeps the real (unpadded) elements of
    the rank's partition in the grad dtype (grads_in_partition: sum of numel of params_in_partition; rank 0 is
    full)."""
    st, rc = job.s.strategy, job.s.recipe
    if st.full_grads_in_backward:
        return rc.grad_bytes * job.psi
    return rc.grad_bytes * min(job.lay.optimizer_numel, job.psi)


def accumulated_grads(job: Job, end: int) -> int:
    """ZeRO-2 under gradient accumulation: each micro-step's reduces fill grads_in_partition, the whole parameters
    that overlap the rank's partition (stage_1_and_2.py copy_grads_in_partition: sum of their numel), and the
    epilogue keeps it as the accumulated gradients (all_grad_tensors' views) while _release_ipg_buffers drops the
    reference: the next micro-step's first reduce makes a new one beside it (measured with the harness: llama-7b 2
    blocks, grad-accum 2, the 2,761,728-byte buffer twice in the second backward)."""
    st, rc, ds = job.s.strategy, job.s.recipe, job.s.ds
    if st.shard_grads and ds.contiguous_gradients and not job.offload_optimizer:
        return max(end, rc.grad_bytes * job.lay.partition_params_numel)
    return end


def offload(job: Job, grads: Grads, host_by: dict[str, int]) -> OffloadedGrads:
    """ZeRO-Offload keeps the optimizer's fp32 gradient partition on the host (stage_1_and_2.py, self.device =
    "cpu"): initialize_optimizer_states' single_grad_partition (fp32, the partition), the bit16 copy of the
    partition for the copy back (param_buffer_of_bit16_for_cpu_offload_groups) and
    temp_grad_buffer_for_cpu_offload (the largest parameter, bit16); temp_grad_buffer_for_gpu_offload (the same
    size) stays on the device; gradients go from the reduce bucket straight to the host (measured on CPU, where
    device and host share the allocator)."""
    rc, opt_numel = job.s.recipe, job.lay.optimizer_numel
    host_by["grads_bytes"] += 4 * opt_numel
    largest = max((t.numel for t in job.inv.trainable_inventory.tensors), default=0)
    host_by["buffers_bytes"] += rc.param_bytes * opt_numel + rc.grad_bytes * largest
    kept = 0
    if job.s.grad_accum > 1 and not job.s.rank.pipeline_stage:
        # under gradient accumulation ZeRO-2 accumulates each gradient of the partition on the host
        # (copy_grads_in_partition -> async_accumulate_grad_in_cpu_via_gpu: accumulated_grads_in_cpu, a zeroed host
        # buffer of each whole parameter overlapping the partition, in its bit16 dtype, made at its first reduce and
        # kept). ZeRO-1 reduces at the boundary only: param.grad accumulates on the device, every gradient whole,
        # and its micro_step_id is still 0 there (setup_buckets counts a backward only once the epilogue has reset
        # ready_for_gradients), so nothing is accumulated on the host. Measured with the harness: llama-7b 2
        # blocks, grad-accum 2, ZeRO-1 -10.67% and ZeRO-2 -5.92% without these.
        if job.s.strategy.shard_grads:
            host_by["grads_bytes"] += rc.grad_bytes * job.lay.partition_params_numel
        else:
            kept = grads.persist
    return OffloadedGrads(device_buffer=rc.grad_bytes * largest, kept_grads=kept)


def pinned_host(inv: ParamInventory, s: Settings, n: int) -> list[int]:
    """ZeRO-Offload with offload_optimizer.pin_memory: the fp32 partition and its fp32 gradient, the bit16 copy of
    the partition and the largest parameter's gradient buffer (stage_1_and_2.py, pinned with get_accelerator()
    .pin_memory)."""
    if not (s.ds.offload_optimizer and s.ds.offload_pin_memory):
        return []
    rc, inv = s.recipe, inv.trainable_inventory  # the trainable parameters' partition (layouts._with_frozen)
    part = ceil_div(ceil_div(inv.num_params, 2 * n) * 2 * n, n)
    largest = max((t.numel for t in inv.tensors), default=0)
    return [4 * part, 4 * part, rc.param_bytes * part, rc.grad_bytes * largest]


def buffers(job: Job, grads: Grads) -> BufferTimeline:
    st, rc, ds = job.s.strategy, job.s.recipe, job.s.ds
    backward = 0
    if st.ds_ipg_buckets and ds.contiguous_gradients:
        # setup_buckets(): allocated in every backward, at the first gradient hook (the head's or the final
        # norm's), so not yet at the loss backward's peak (measured: the backward-start phase was over by exactly
        # the bucket, +0.45% to +0.76%); from the last block's backward on; doubled with overlap_comm
        backward = (2 if job.overlap else 1) * ds.reduce_bucket_size * rc.grad_bytes
    moments: list[BufferMoment] = []
    epilogue = 0
    if backward:
        # the bucket, set up in the first gradient hook (the head's weight's, or the final norm's where the head
        # is tied) while that gradient is still in its own storage (it is copied into the bucket after), and
        # beside what is alive at the root's last hook before the blocks (the final norm's). Measured: phi3-mini-4l
        # ZeRO-2 offload at micro-batch 1 peaks in the head's hook (bench/gpu/traces/phi3_z2off1)
        moments.append(BufferMoment(0, 0, Moment.ROOT_FIRST_HOOK))
        moments.append(BufferMoment(0, 0, Moment.ROOT_LAST_HOOK_BEFORE_BLOCKS))
        if st.shard_grads or job.overlap:
            # inside the blocks' backward (a recomputed block is the peak there): once a bucket has been reduced,
            # grads_in_partition (the whole parameters overlapping the rank's partition, in the grad dtype)
            # exists, and a tied weight's first contribution waits for the embedding's (measured with the harness:
            # gpt2 ZeRO-2 at 4 ranks with full recompute was -13% without these). Under ZeRO-Offload the reduced
            # gradients go to the host (no grads_in_partition; the replay had these moments up to 20% above
            # the engine without them: falcon-7b, 4 blocks, full recompute, micro-batch 1)
            tied = job.grad_gathers.tied
            in_part = job.lay.partition_params_numel if ds.reduce_bucket_size < job.psi and \
                not job.offload_optimizer else 0
            # under gradient accumulation ZeRO-2's new grads_in_partition is beside the accumulated one
            # (accumulated_grads): the moment holds both
            kept = grads.persist if st.shard_grads and job.s.grad_accum > 1 and in_part else 0
            for at in (Moment.INSIDE_LAST_BLOCK_BACKWARD, Moment.INSIDE_PREVIOUS_BLOCK_BACKWARD,
                       Moment.INSIDE_FIRST_BLOCK_BACKWARD):
                moments.append(BufferMoment(0, rc.grad_bytes * (in_part + tied) + kept, at))
        elif st.zero_stage == 1:
            # ZeRO-1 without overlap_comm reduces nothing in its gradient hooks (process_gradients: only with
            # partition_gradients or overlap_comm; the hook just sets up the bucket): every gradient stays as
            # autograd made it until reduce_gradients after backward, as under DDP. After backward, the first
            # bucket's reduce allocates grads_in_partition beside all of them (copy_grads_in_partition).
            # Measured with the harness: gpt2, fp32, 2 ranks: +8.24% before.
            moments += unreduced_grad_moments(job.grad_gathers, rc.grad_bytes, job.psi)
            if ds.contiguous_gradients and not job.offload_optimizer:
                epilogue = rc.grad_bytes * job.lay.partition_params_numel
    hook = NO_HOOK_TRANSIENT
    if job.offload_optimizer and st.ds_ipg_buckets:
        # ZeRO-Offload: each reduce copies every gradient of the rank's partition to the host
        # (stage_1_and_2.py copy_grads_in_partition): set_norm_for_param_grad_in_gpu takes its norm through an
        # fp64 copy (``.to(get_norm_dtype()).norm(2)``), freed before async_inplace_copy_grad_to_fp32_buffer_from_gpu's
        # fp32 copy: 8 bytes a gradient element at its reduce (the replay, frameworks/zero12_replay.py Offload, has
        # each in its place; measured there: bench/gpu/traces/l1b_z2off). Reducing in the hooks (ZeRO-2,
        # overlap_comm) a bucket's gradients are copied at the hook that overflows it: the head's with the final
        # norm's, a block parameter's about its own hook (profile.block_hooks), the embedding's at backward's end;
        # ZeRO-1 reduces after backward, every gradient still alive, the largest copy first (module order). A
        # parameter is whole in the first rank's partition (the largest, which holds the model's first elements).
        # A gradient larger than the bucket is not copied into it but kept apart to its reduce
        # (extra_large_param_to_reduce), so it is alive beside its copy.
        gg = job.grad_gathers

        def copy(numel: int) -> int:
            return (OFFLOAD_NORM_BYTES + (rc.grad_bytes if numel > ds.reduce_bucket_size else 0)) * numel
        if st.shard_grads or job.overlap:
            bucket, head = ds.reduce_bucket_size, gg.head_largest_tensor
            lead = max(gg.root_head - gg.tied, 0)
            lead, lead_largest = (lead - head, 0) if head > bucket else (lead, head)
            moments.append(BufferMoment(copy(head) if head > bucket else 0, 0, Moment.ROOT_LAST_HOOK_BEFORE_BLOCKS))
            hook = HookTransient(chunk_per=OFFLOAD_NORM_BYTES, apart_over=bucket, apart_per=rc.grad_bytes,
                                 bucket=bucket, lead=lead, lead_largest=lead_largest,
                                 depth=len(job.inv.layer_blocks), own_per=rc.grad_bytes)
            moments.append(BufferMoment(0, 0, Moment.BLOCK_GRADIENT_HOOK))
            epilogue = hook.tail([t.numel for t in reversed(job.inv.trainable_inventory.tensors)])
        else:
            epilogue = offload_reduce_after_backward(job)
    if st.zero_stage == 0:
        # no gradient hooks: every gradient stays as autograd made it until allreduce_gradients after backward,
        # as under DDP (the replay, zero12_replay.replay_zero0, peaked inside the first block's backward 8% above
        # the engine without these: falcon-7b, 4 blocks, full recompute)
        moments += unreduced_grad_moments(job.grad_gathers, rc.grad_bytes, job.psi)
        # allreduce_bucket: the chunk flattened, then cast when communication_data_type differs (both alive)
        comm = comm_bytes(job.s)
        epilogue = (rc.grad_bytes + (comm if comm != rc.grad_bytes else 0)) * allreduce_chunk(job)
    moments.append(LOSS)
    held = 0
    if st.zero_stage == 1 and job.s.grad_accum > 1 and not job.s.rank.pipeline_stage:
        # ZeRO-1 under gradient accumulation: setup_buckets runs at the first micro-step's first hook, and only the
        # boundary's reduce_gradients -> independent_gradient_partition_epilogue releases the bucket
        # (_release_ipg_buffers): it is alive through every later micro-step's forward and backward, not at the
        # step (ZeRO-2 releases it at each backward's epilogue). Measured with the harness: llama-7b 2 blocks,
        # grad-accum 2, full recompute.
        held, backward = backward, 0
    return BufferTimeline(backward=backward, end_epilogue=epilogue, moments=tuple(moments), hook_transient=hook,
                          micro_steps_held=held,
                          first_hook_grads_persist=st.zero_stage == 1 and not (st.shard_grads or job.overlap))


#: ZeRO-Offload's norm of a gradient before its copy to the host: an fp64 copy (get_norm_dtype), 8 bytes an element
OFFLOAD_NORM_BYTES = 8


def offload_reduce_after_backward(job: Job) -> int:
    """ZeRO-1 with ZeRO-Offload reduces after backward (stage_1_and_2.py reduce_gradients, module order, every
    gradient alive until then): reduce_independent_p_g_buckets_and_remove_grads copies a gradient into the bucket
    (its own storage freed), or, larger than the bucket, keeps it apart as extra_large_param_to_reduce (cloned
    first under offload: ``grad_reduc.detach().clone()``); a gradient that would overflow the bucket reduces it
    first, and each reduced gradient in the rank's partition is copied to the host through its fp64 norm copy
    (copy_grads_in_partition), the extra-large one's freed after it (clear_grad_attribute). The most this holds
    beyond the parameters and the bucket, in bytes: gradients still alive and the transient."""
    gb, bucket = job.s.recipe.grad_bytes, job.s.ds.reduce_bucket_size
    tensors = job.inv.trainable_inventory.tensors
    numels = [t.numel for t in tensors]
    inside = partition_overlaps(numels, job.n)
    alive = most = gb * sum(numels)
    pending: list[tuple[int, int, bool]] = []
    in_bucket = 0

    def flush() -> None:
        nonlocal alive, most
        for n, copied, extra in pending:
            most = max(most, alive + OFFLOAD_NORM_BYTES * copied)
            if extra:
                alive -= gb * n
        pending.clear()
    for n, copied in zip(numels, inside):
        if in_bucket + n > bucket:
            flush()
            in_bucket = 0
        if n > bucket:
            most = max(most, alive + gb * n)  # the clone beside the gradient
            pending.append((n, copied, True))
        else:
            alive -= gb * n
            pending.append((n, copied, False))
        in_bucket += n
    flush()
    return most


def partition_overlaps(numels: list[int], n: int) -> list[int]:
    """Elements of each parameter (module order) inside the first rank's part of the flat group
    (flatten_dense_tensors_aligned: the group padded to 2 x ranks, each rank a contiguous part)."""
    part = ceil_div(ceil_div(sum(numels), 2 * n) * 2 * n, n)
    out, start = [], 0
    for numel in numels:
        out.append(max(0, min(start + numel, part) - start))
        start += numel
    return out


def comm_bytes(s: Settings) -> int:
    """Bytes per element of the dtype DeepSpeed reduces gradients in: communication_data_type, else the
    parameters' (engine.py communication_data_type: fp16 or bf16 when enabled, else fp32)."""
    named = s.ds.communication_data_type
    if named is not None:
        return 4 if named == "fp32" else 2
    return s.recipe.grad_bytes


#: engine.py MEMORY_OPT_ALLREDUCE_SIZE: allreduce_gradients' elements per flattened chunk
ALLREDUCE_CHUNK = 500_000_000


def allreduce_chunk(job: Job) -> int:
    """Stage 0's all-reduce after backward (engine.py allreduce_gradients -> buffered_allreduce_fallback ->
    allreduce_no_retain): the gradients, in module order, are flattened into a copy chunk by chunk, a chunk closed
    once it holds more than 500M elements, all-reduced and copied back; the largest chunk, in elements, exists
    beside every gradient (measured on CPU in fp32, where it is the peak: docs/accuracy.md session 18)."""
    best = cur = 0
    for t in job.inv.trainable_inventory.tensors:
        cur += t.numel
        if cur > ALLREDUCE_CHUNK:
            best, cur = max(best, cur), 0
    return max(best, cur)


def step(job: Job, s: StepIn) -> tuple[int, int, dict[str, int]]:
    """The step (stage_1_and_2.py step): the partition's gradients (averaged_gradients: views of the grads of
    params_in_partition, the others freed just before) are flattened into a copy in the grad dtype
    (flatten_dense_tensors_aligned, padded to the partition) and cast to fp32 (single_grad_partition); only then
    are the copy and the grads freed and the optimizer run. Measured on the H100: mixtral-8x7b with one block
    under ZeRO-2 peaks there, a 6.85 GB fp32 partition beside the 3.43 GB flat copy and the 3.43 GB grads (-11.9%
    without this moment). Grads already fp32 (under torch.autocast): the cast returns the flat copy itself."""
    st, rc = job.s.strategy, job.s.recipe
    if st.zero_stage == 0 and s.master_bytes:
        return _fp16_optimizer_step(job, s)
    if not (st.ds_ipg_buckets and s.master_bytes and not job.offload_optimizer):
        return s.grads, s.buffers, {}
    # the gradients accumulated over the micro-steps were reduced at the boundary like one micro-step's: at the
    # step only the fp32 partition holds them (measured: grad-accum 2 peaks at the step exactly as 1 does).
    # DeepSpeed's PipelineEngine reduces outside ZeRO's hooks (reduce_gradients(pipeline_parallel=True)) and
    # is not measured so: it keeps them (its rows: +3.10% with them, -4.23% without)
    if not job.s.rank.pipeline_stage:
        s = replace(s, grads=s.grads - s.grads_persist)
    opt_numel = job.lay.optimizer_numel
    cast = rc.reduced_grad_bytes * opt_numel if rc.grad_bytes != rc.reduced_grad_bytes else 0
    flat_grads = rc.grad_bytes * job.lay.partition_params_numel + cast
    flat_buffers = s.persistent + rc.grad_bytes * opt_numel
    if flat_grads + flat_buffers > s.grads + s.buffers:
        return flat_grads, flat_buffers, {}
    return s.grads, s.buffers, {}


def _fp16_optimizer_step(job: Job, s: StepIn) -> tuple[int, int, dict[str, int]]:
    """Stage 0's 16-bit wrappers at the step (deepspeed/runtime/fp16, 0.19.8), the 16-bit gradients on the
    parameters:
    - FP16_Optimizer (DeepSpeed's FusedAdam, fused_optimizer.py step): every gradient cast to fp32 in a list, then
      flattened into the fp32 group's gradient (_flatten_dense_tensors: both alive), the 16-bit gradients freed;
      FusedAdam steps the flat group;
    - FP16_UnfusedOptimizer (a torch optimizer, unfused_optimizer.py step): each fp32 master's gradient is its
      16-bit gradient cast to fp32, all of them alive with the 16-bit ones through the torch optimizer's step.
    Measured (CPU, the unfused one): docs/accuracy.md session 18."""
    rc, psi = job.s.recipe, job.psi
    half = rc.grad_bytes * psi
    if fp16_wrapper(job.s) == "fused":
        flatten = (half + 2 * 4 * psi, s.persistent)
        stepping = (4 * psi, s.persistent + s.scratch)
        return (*max(flatten, stepping, key=sum), {})
    return half + 4 * psi, s.persistent + s.scratch, {}


def fp16_wrapper(s: Settings) -> str | None:
    """Stage 0's optimizer wrapper in DeepSpeed 0.19.8 (engine.py _configure_fp16_optimizer): "fused" is
    FP16_Optimizer, taken only when the basic optimizer is DeepSpeed's own FusedAdam (``isinstance(optimizer,
    FusedAdam)``), which DeepSpeed builds from its config's optimizer section on CUDA (no --optimizer-impl named);
    "unfused" is FP16_UnfusedOptimizer, around any torch optimizer the job hands it (an implementation named:
    foreach, fused or single-tensor are torch.optim's; the HF Trainer's default optim) and on CPU; None with fp32
    parameters (no wrapper, engine.py _do_optimizer_sanity_check)."""
    if s.strategy.zero_stage != 0 or not (s.strategy.fp32_master_copy or s.recipe.master_bytes):
        return None
    return "fused" if optimizer_impl(s) == "fused" and s.optimizer_impl is None else "unfused"


def optimizer_tensors(job: Job) -> tuple[tuple[tuple[int, ...], int], ...]:
    """What the optimizer steps: ZeRO-1/2's one flat fp32 partition (single_partition_of_fp32_groups), stage 0's
    flat fp32 group under its 16-bit wrappers (bf16_optimizer.py fp32_groups_flat_partition, fp16/fused_optimizer.py
    fp32_groups_flat); stage 0 in fp32 has no wrapper and hands the module's parameters as they are (engine.py
    _do_optimizer_sanity_check returns None: the client optimizer itself)."""
    st, rc = job.s.strategy, job.s.recipe
    if st.zero_stage == 0 and rc.param_bytes == 4 and not st.fp32_master_copy and not rc.master_bytes:
        return tuple((t.shape, t.numel) for t in job.inv.trainable_inventory.tensors)
    if fp16_wrapper(job.s) == "fused":
        return (((job.psi,), job.psi),)  # FP16_Optimizer's one flat fp32 group
    return job.lay.shard_shapes


MODEL = FrameworkModel(name="zero12", replay="memplan.frameworks.zero12_replay", buffers=buffers,
                       half_autocast_why_not="DeepSpeed casts the module to its own 16-bit dtype with an fp32 master partition "
                                             "(engine.py): the Trainer's bf16 there is deepspeed-bf16",
                       
                       grads_at_end=grads_at_end, accumulated_grads=accumulated_grads, offload=offload, step=step,
                       zero_offload=True,
                       pinned_host=pinned_host, optimizer_tensors=optimizer_tensors)
