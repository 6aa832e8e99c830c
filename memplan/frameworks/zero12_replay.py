"""The reserved-peak replay of DeepSpeed ZeRO-1/2 (DeepSpeedZeroOptimizer's setup and step order)."""

from __future__ import annotations

from typing import Any

from memplan.allocator import Allocator, AllocatorConfig
from memplan.replay import MAX_STEPS, ReplayJob, Run, build_model, micro_step, optimizer_step


def _partition_params(inv: Any, n: int) -> tuple[int, ...]:
    """Elements of each parameter (module order) that overlaps the largest rank's part of the flat group: the
    gradients that rank's norm reads (stage_1_and_2.py params_in_partition). The last rank's part holds the
    padding, so the first rank is taken."""
    from memplan.units import ceil_div

    trained = [t for t in inv.tensors if t.trainable]  # the optimizer's groups: what requires grad (LoRA)
    psi = sum(t.numel for t in trained)
    part = ceil_div(ceil_div(psi, 2 * n) * 2 * n, n)
    out, start = [], 0
    for t in trained:
        if start < part:
            out.append(t.numel)
        start += t.numel
    return tuple(out)


def replay_zero12(job: ReplayJob, stage: int, partition: int, flat: int, bucket: int, buffers: int,
                  norms: tuple[int, ...], half: int = 2, config: AllocatorConfig | None = None,
                  offload: Offload | None = None, trainable: tuple[bool, ...] | None = None) -> Allocator:
    """DeepSpeed ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer) with a fused Adam,
    per rank, in its elements: ``flat`` (the aligned flat bit16 group), ``partition`` (this rank's), ``bucket``
    (reduce_bucket_size), ``buffers`` (2 with overlap_comm), ``norms`` (the elements of each parameter whose
    gradient the rank's norm reads, in order).

    Setup, as recorded on the H100 (../shared/gpu/traces/zero2): the engine converts the built model to the
    half dtype parameter by parameter and empties the cache; the optimizer flattens the group into one buffer
    (flatten_dense_tensors_aligned) and the parameters become views of it; the fp32 master partition is the
    bit16 partition's .clone().float(); initialize_optimizer_states makes and drops an fp32 gradient partition.
    A step: at the first gradient hook the ipg bucket buffer(s) (contiguous_gradients) are made; ZeRO-2 (and
    overlap_comm) takes each gradient into them as it is made, ZeRO-1 keeps its gradients to the end of backward
    and takes them then; the first reduce (a full bucket, or the last) makes grads_in_partition; the bucket goes
    at the end of backward; the norm takes each gradient in fp64 (get_grad_norm_direct:
    vector_norm(g.data.to(get_norm_dtype()))); the step flattens the partition's gradients again and converts them to fp32
    (single_grad_partition), Adam makes its states at the first step, and the fp32 gradient goes.

    ZeRO-Offload (``offload``): see Offload; the optimizer and its states live on the host."""
    run = setup_zero12(job, partition, flat, half, config, offload, trainable)
    for n in range(MAX_STEPS):
        before = run.a.peak_reserved
        red = Reducer(run, partition, half, bucket, offload)
        #: ZeRO-1's gradients as autograd keeps them across the micro-steps (param.grad, the later micro-steps'
        #: added in place: theirs die at once), reduced at the boundary only
        acc: list[tuple[Any, int]] = []
        #: the bucket buffer(s): made at the first gradient hook (setup_buckets), released by the epilogue
        #: (_release_ipg_buffers), which ZeRO-1 runs at the boundary only
        ipg: list[Any] = []
        for m in range(job.grad_accum):
            boundary = m == job.grad_accum - 1
            ids = run.alloc(job.input_bytes)
            # process_gradients: every hook sets up the bucket buffer(s); ZeRO-2 (partition_gradients) reduces in
            # the hooks, and overlap_comm does at the boundary (reduce_ready_partitions_and_remove_grads); ZeRO-1
            # without it keeps the gradients until reduce_gradients takes them one by one at the end of the
            # boundary's backward (stage_1_and_2.py process_gradients)
            in_hooks = stage == 2 or (buffers > 1 and boundary)
            seen = [0]
            if offload is not None:
                offload.seen = 0
                offload.module_order = not in_hooks

            def on_grad(nbytes: int, key: Any, *_: Any, in_hooks: bool = in_hooks, seen: list[int] = seen) -> bool:
                if not ipg:
                    ipg.extend(run.alloc(bucket * half) for _ in range(buffers))
                i = seen[0]
                seen[0] += 1
                if in_hooks and stage == 1 and acc:
                    # the hook reduces param.grad, into which this micro-step's gradient was just added
                    k, size = acc[i]
                    if not red.reduce(size, k):
                        run.free(k)
                    return False
                return in_hooks and red.reduce(nbytes, key)
            kept = micro_step(run, job, keep_grads=not in_hooks and not acc, on_grad=on_grad)
            if stage == 1 and not acc:
                acc = kept
            if boundary and not in_hooks:
                red.reduce_all(acc)
            if red.pending or (red.grads_flat is None and offload is None and (boundary or stage == 2)):
                red.flush()  # the epilogue's reduce
            if stage == 2 or boundary:
                for k in ipg:
                    run.free(k)
                ipg.clear()
            if stage == 2 and not boundary and offload is None:
                # the epilogue keeps this micro-step's grads_in_partition as the accumulated gradients
                # (all_grad_tensors' views) and drops its own reference: the next reduce makes a new one, added into
                # these at the next epilogue and freed
                if m == 0:
                    acc = [(red.grads_flat, 0)]
                else:
                    run.free(red.grads_flat)
                red.grads_flat = None
            run.free(ids)
        if stage == 2 and acc and offload is None:
            if red.grads_flat is not None:
                run.free(red.grads_flat)
            red.grads_flat = acc[0][0]
        if offload is None:
            optimizer_step_zero12(run, job, norms, partition, half, red.grads_flat, first=n == 0)
        run.end_step()
        if n >= 1 and run.a.peak_reserved == before:
            break
    return run.a


class Reducer:
    """One boundary's reduce of ZeRO-1/2 (stage_1_and_2.py): the gradients taken into the ipg bucket one by one,
    the bucket reduced when the next would overflow it and at the end. ``grads_flat``: grads_in_partition, made
    at the first reduce (the rank's partition of the reduced gradients, bit16)."""

    def __init__(self, run: Run, partition: int, half: int, bucket: int, offload: Offload | None) -> None:
        self.run, self.partition, self.half, self.bucket, self.offload = run, partition, half, bucket, offload
        self.grads_flat: Any = None
        #: the bucket's gradients: (elements, the key of one kept apart, larger than the bucket, else None)
        self.pending: list[tuple[int, Any]] = []
        self.in_bucket = 0

    def flush(self) -> None:
        """reduce_ipg_grads: the first reduce makes grads_in_partition (copy_grads_in_partition); with
        ZeRO-Offload each gradient in the rank's partition is copied to the host instead (Offload). A
        gradient kept apart (extra_large_param_to_reduce) is freed once copied: into grads_in_partition
        (``grad_reduc.data = new_grad_tensor``), or to the host (clear_grad_attribute)."""
        run, offload = self.run, self.offload
        if offload is None and self.grads_flat is None:
            self.grads_flat = run.alloc(self.partition * self.half)
        for numel, apart in self.pending:
            if offload is not None:
                offload.copy_to_host(run, numel)
            if apart is not None:
                run.free(apart)
        self.pending.clear()
        self.in_bucket = 0

    def reduce(self, nbytes: int, key: Any) -> bool:
        """reduce_independent_p_g_buckets_and_remove_grads: a gradient that would overflow the bucket
        reduces it first; one larger than the bucket stays apart until its reduce (cloned first under
        ZeRO-Offload: ``grad_reduc.data = grad_reduc.detach().clone()``), the others are copied into it
        (their storage freed). Returns whether the gradient's storage is kept apart."""
        numel = nbytes // self.half
        if self.in_bucket + numel > self.bucket:
            self.flush()
        self.in_bucket += numel
        if numel > self.bucket:
            if self.offload is not None:
                clone = self.run.alloc(nbytes)
                self.run.free(key)
                key = clone
            self.pending.append((numel, key))
            return True
        self.pending.append((numel, None))
        return False

    def reduce_all(self, grads: list[tuple[Any, int]]) -> None:
        """reduce_gradients without overlap_comm: every gradient kept on its parameter, in the group's (module)
        order (``grads`` in the order backward made them)."""
        for key, nbytes in reversed(grads):
            if not self.reduce(nbytes, key):
                self.run.free(key)  # copied into the bucket: the gradient is a view of it now


class Offload:
    """ZeRO-Offload of the optimizer (offload_optimizer.device cpu), DeepSpeed 0.19.8 stage_1_and_2.py, on the
    device: the fp32 master partition is made on the host from a device clone of the bit16 partition
    (``.detach().clone().to(device="cpu", dtype=fp32)``: the clone is a device temporary), and
    temp_grad_buffer_for_gpu_offload (zeros of the largest parameter, bit16) stays; in each reduce every gradient
    in the rank's partition is copied to the host's fp32 gradient: copy_grads_in_partition ->
    set_norm_for_param_grad_in_gpu (``.to(float64).norm(2)``: an fp64 temporary) and
    async_inplace_copy_grad_to_fp32_buffer_from_gpu (``src.to(fp32)`` then a non-blocking copy: an fp32
    temporary); the step runs on the host and copies the bit16 partition back (same dtype: no temporary).
    Measured: bench/gpu/traces/l1b_z2off and q05_z2off.

    ``largest``: elements of the largest parameter; ``psi``: the model's elements; ``partition``: this rank's
    (the first rank's, which holds the first elements in module order: the gradients that come last in
    backward)."""

    def __init__(self, largest: int, psi: int, partition: int, half: int, last_rank: bool = False) -> None:
        self.largest, self.psi, self.partition, self.half = largest, psi, partition, half
        self.seen = 0  # gradient elements reduced so far in this backward (the replay resets it)
        #: the reduces come in module order (ZeRO-1's reduce_gradients after backward), else in backward's
        self.module_order = False
        #: the rank replayed holds the flat group's last part (the last parameters in module order, the first
        #: reduced in backward: the head's, while every activation is alive), else its first part
        self.last_rank = last_rank

    def _part(self) -> tuple[int, int]:
        """The rank's real elements as [start, end) in module order (the last part ends with the padding)."""
        if not self.last_rank:
            return 0, min(self.partition, self.psi)
        return max(self.psi - (self.psi % self.partition or self.partition), 0), self.psi

    def copy_to_host(self, run: Run, numel: int) -> None:
        self.seen += numel
        start, end = self._part()
        # the gradient's elements in module order: reduced in module order, or from the end in backward's
        lo, hi = (self.seen - numel, self.seen) if self.module_order else (self.psi - self.seen,
                                                                           self.psi - self.seen + numel)
        inside = max(0, min(hi, end) - max(lo, start))
        if inside:
            run.free(run.alloc(inside * 8))  # the norm's fp64 copy
            if self.half != 4:
                run.free(run.alloc(inside * 4))  # the fp32 copy sent to the host


def setup_zero12(job: ReplayJob, partition: int, flat: int, half: int, config: AllocatorConfig | None,
           offload: Offload | None = None, trainable: tuple[bool, ...] | None = None) -> Run:
    """The model built and converted, the cache emptied, the flat bit16 group (the parameters become views of it),
    the fp32 master partition (a clone made fp32) and initialize_optimizer_states' zero gradient; with
    ZeRO-Offload the partition's device clone and the largest parameter's gradient buffer. ``trainable`` (LoRA,
    module order): the optimizer's groups hold only the parameters that require grad, so only those are
    flattened; the frozen ones keep their own storage."""
    run = Run(config or AllocatorConfig(), job.buffers)
    keys = build_model(run, job)
    run.empty_cache()
    run.alloc(flat * half)  # bit16_groups_flat
    for i, k in enumerate(keys):
        if trainable is None or (i < len(trainable) and trainable[i]):
            run.free(k)
    if offload is not None:
        run.free(run.alloc(partition * half))  # .detach().clone(), then .to("cpu", fp32)
        run.alloc(offload.largest * half)  # temp_grad_buffer_for_gpu_offload
        return run
    clone = run.alloc(partition * half)
    run.alloc(partition * 4)  # single_partition_of_fp32_groups
    run.free(clone)
    run.free(run.alloc(partition * 4))
    return run


def optimizer_step_zero12(run: Run, job: ReplayJob, norms: tuple[int, ...], partition: int, half: int, grads_flat: Any,
                    first: bool) -> None:
    """get_grad_norm_direct (each gradient .to(float64), one after another), then the partition's gradients
    flattened (bit16) and made fp32, grads_in_partition freed, Adam's states at the first step, the step."""
    for numel in norms:
        run.free(run.alloc(numel * 8))
    copy = run.alloc(partition * half)
    if half == 4:  # fp32 parameters (torch_autocast, fp32): .to(fp32) returns the flattened copy itself
        fp32_grad = copy
    else:
        fp32_grad = run.alloc(partition * 4)
        run.free(copy)
    if grads_flat is not None:
        run.free(grads_flat)
    if first:
        job.first_states(run, [])
        for b in job.state_allocs(partition):
            run.alloc(b)
    run.free(fp32_grad)


def replay_zero0(job: ReplayJob, wrapper: str | None, grad_numels: tuple[int, ...], grad_bytes: int,
                 comm_bytes: int, config: AllocatorConfig | None = None,
                 trainable: tuple[bool, ...] | None = None) -> Allocator:
    """DeepSpeed stage 0 (no ZeRO), 0.19.8, per rank. Setup (engine.py __init__): the built model's parameters
    cast to the 16-bit dtype one by one (_cast_module_mixed_precision: ``p.data = p.data.to(dtype)``; no
    empty_cache at stage 0), then the optimizer wrapper (zero12.fp16_wrapper):

    - "unfused", FP16_UnfusedOptimizer (deepspeed/runtime/fp16/unfused_optimizer.py): each fp32 master is
      ``p.clone().float()`` (the clone a temporary); initialize_optimizer_states gives every 16-bit parameter
      and every master a zero gradient and steps the torch optimizer once (its states made at setup), then drops
      the gradients, 16-bit ones first;
    - "fused", FP16_Optimizer (fused_optimizer.py): the 16-bit parameters cloned into a list and flattened into
      one group, the list dropped (CPython frees a list's items last first) and each parameter's storage replaced
      by a view of the group; the fp32 master is the group's ``.clone().float()``; initialize_optimizer_states
      steps FusedAdam once with a zero flat gradient;
    - None (fp32 parameters): the torch optimizer itself, states at its first step.

    A step: the gradients stay on the parameters to the end of backward, which all-reduces them
    (allreduce_gradients -> buffered_allreduce_fallback -> allreduce_no_retain: module order, a chunk flattened
    once it holds more than 500M elements, cast when communication_data_type differs, copied back and dropped);
    then the wrapper's step:

    - unfused: get_weight_norm takes each gradient ``.float()`` one after another, each master's gradient is its
      16-bit gradient ``.to(fp32)`` (all alive), the torch optimizer steps, the fp32 gradients go in order, and
      the engine's zero_grad drops the 16-bit ones;
    - fused: every gradient ``.to(fp32)`` in a list, flattened into the group's fp32 gradient, the list dropped,
      the 16-bit gradients set to None in order, FusedAdam steps, the flat gradient goes.

    ``grad_numels``: the elements of each trainable parameter, module order (what the chunks take)."""
    run, states = setup_zero0(job, wrapper, grad_numels, grad_bytes, config, trainable)
    for n in range(MAX_STEPS):
        before = run.a.peak_reserved
        grads: list[tuple[Any, int]] = []
        for m in range(job.grad_accum):
            ids = run.alloc(job.input_bytes)
            grads += micro_step(run, job, keep_grads=m == 0)
            run.free(ids)
        reduce_and_step_zero0(run, job, wrapper, grad_numels, grad_bytes, comm_bytes, grads, states, n == 0)
        run.end_step()
        if n >= 1 and run.a.peak_reserved == before:
            break
    return run.a


def setup_zero0(job: ReplayJob, wrapper: str | None, grad_numels: tuple[int, ...], half: int,
                config: AllocatorConfig | None, trainable: tuple[bool, ...] | None) -> tuple[Run, list[Any]]:
    """Stage 0's setup (replay_zero0): the model built, then the wrapper's groups; (the run, the optimizer's
    states)."""
    run = Run(config or AllocatorConfig(), job.buffers)
    keys = build_model(run, job)
    states: list[Any] = []
    if wrapper == "unfused":
        for n in grad_numels:
            clone = run.alloc(n * half)
            run.alloc(n * 4)  # the fp32 master
            run.free(clone)
        zeros = [run.alloc(n * half) for n in grad_numels] + [run.alloc(n * 4) for n in grad_numels]
        optimizer_step(run, job, True, states)
        for k in zeros:
            run.free(k)
    elif wrapper == "fused":
        psi = sum(grad_numels)
        clones = [run.alloc(n * half) for n in grad_numels]
        run.alloc(psi * half)  # fp16_groups_flat
        for k in reversed(clones):
            run.free(k)
        for i, k in enumerate(keys):  # p.data = the group's view (the optimizer's parameters: those that train)
            if trainable is None or (i < len(trainable) and trainable[i]):
                run.free(k)
        clone = run.alloc(psi * half)
        run.alloc(psi * 4)  # fp32_groups_flat
        run.free(clone)
        zero = run.alloc(psi * 4)
        optimizer_step(run, job, True, states)
        run.free(zero)
    return run, states


def reduce_and_step_zero0(run: Run, job: ReplayJob, wrapper: str | None, grad_numels: tuple[int, ...],
                          grad_bytes: int, comm_bytes: int, grads: list[tuple[Any, int]], states: list[Any],
                          first: bool) -> None:
    """Stage 0 after the boundary's backward (replay_zero0): allreduce_no_retain's chunks, the wrapper's step,
    zero_grad; ``grads``: the gradients kept on the parameters, in the order backward made them."""
    from memplan.frameworks.zero12 import ALLREDUCE_CHUNK

    half = grad_bytes
    chunk = 0
    for i, numel in enumerate(grad_numels):  # allreduce_no_retain
        chunk += numel
        if chunk > ALLREDUCE_CHUNK or i == len(grad_numels) - 1:
            flat = run.alloc(chunk * grad_bytes)
            if comm_bytes != grad_bytes:
                run.free(run.alloc(chunk * comm_bytes))
            run.free(flat)
            chunk = 0
    if wrapper == "unfused":
        if half != 4:
            for numel in grad_numels:  # get_weight_norm: p.data.float().norm()
                run.free(run.alloc(numel * 4))
        fp32 = [run.alloc(numel * 4) for numel in grad_numels]
        optimizer_step(run, job, False, states)
        for k in fp32:
            run.free(k)
    elif wrapper == "fused":
        casts = [run.alloc(numel * 4) for numel in grad_numels]
        flat = run.alloc(sum(grad_numels) * 4)
        for k in reversed(casts):
            run.free(k)
        for k, _ in reversed(grads):
            run.free(k)
        grads = []
        optimizer_step(run, job, False, states)
        run.free(flat)
    else:
        optimizer_step(run, job, first, states)
    for k, _ in reversed(grads):  # zero_grad(set_to_none=True)
        run.free(k)


def why_not(s: Any) -> str | None:
    """DeepSpeed setups not written down yet (ZeRO-Offload of parameters, ZeRO++ hpZ)."""
    st = s.strategy
    if st.zero_stage == 0:
        return None
    if st.zero_stage in (1, 2) and s.ds.offload_optimizer and not s.ds.offload_param \
            and s.ds.hpz_partition_size <= 1:
        return None
    if st.zero_stage not in (1, 2, 3) or s.ds.offload_optimizer or s.ds.offload_param or s.ds.hpz_partition_size > 1:
        what = "ZeRO-Offload" if s.ds.offload_optimizer or s.ds.offload_param else (
            "ZeRO++ hpZ" if s.ds.hpz_partition_size > 1 else f"stage {st.zero_stage}")
        return f"DeepSpeed {what} not modelled yet"
    return None


def replay(inv: Any, s: Any, config: AllocatorConfig) -> tuple[str, dict[str, Allocator]]:
    from memplan.replay import replay_job
    from memplan.settings import shard_group_size
    from memplan.units import ceil_div

    st, n = s.strategy, shard_group_size(s)
    if st.zero_stage == 0:
        from memplan.frameworks.zero12 import comm_bytes, fp16_wrapper

        wrapper = fp16_wrapper(s)
        stepped = [t for t in inv.tensors if t.trainable]
        numels = [t.numel for t in stepped]
        if wrapper == "fused":
            job = replay_job(inv, s, [sum(numels)])
        else:
            job = replay_job(inv, s, numels, [t.shape for t in stepped])
        a = replay_zero0(job, wrapper, tuple(numels), s.recipe.grad_bytes, comm_bytes(s), config,
                         tuple(t.trainable for t in inv.tensors) if inv.frozen else None)
        names = {"fused": "FP16_Optimizer", "unfused": "FP16_UnfusedOptimizer", None: "no wrapper"}
        return f"DeepSpeed stage 0 ({names[wrapper]})", {"": a}
    trained = [t for t in inv.tensors if t.trainable]  # the optimizer's groups (LoRA: the adapters)
    psi = sum(t.numel for t in trained)
    flat = ceil_div(psi, 2 * n) * 2 * n  # flatten_dense_tensors_aligned(..., 2 * dp_size)
    part = flat // n
    job = replay_job(inv, s, [part])
    args = (job, st.zero_stage, part, flat, s.ds.reduce_bucket_size, 2 if s.ds.overlap_comm else 1,
            _partition_params(inv, n), s.recipe.param_bytes, config)
    trainable = tuple(t.trainable for t in inv.tensors) if inv.frozen else None
    if not s.ds.offload_optimizer:
        return f"ZeRO-{st.zero_stage}", {"": replay_zero12(*args, None, trainable)}
    # ZeRO-Offload: what each reduce copies to the host through the device depends on the rank's part of the flat
    # group; the first part's and the last part's ranks are replayed (the engine takes the worst rank)
    largest = max((t.numel for t in trained), default=0)
    return f"ZeRO-{st.zero_stage} Offload", {
        f"rank {r}": replay_zero12(*args, Offload(largest, psi, part, s.recipe.param_bytes, last_rank=r > 0),
                                   trainable) for r in (0, n - 1)}
