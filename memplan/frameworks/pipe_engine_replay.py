"""The reserved-peak replay of a pipeline rank under DeepSpeed's PipelineEngine (the megatron-deepspeed layout:
one stage per rank, ZeRO stage 0 or 1), walked one TrainSchedule command at a time through the caching
allocator, the stage's traced step split at its forward's end as frameworks/pipeline_replay.py splits it.

What each command does, from DeepSpeed 0.19.8's deepspeed/runtime/pipe/engine.py and schedule.py:

- TrainSchedule runs the stage's forwards and backwards in 1F1B order (the same as torch's Schedule1F1B,
  parallel/schedules.py, warm-up capped at the micro-batches) over ``num_pipe_buffers()`` = max(2, min(stages -
  stage_id, micro_batches)) buffer slots, micro-batch k in slot k mod that; the slots (pipe_buffers) are never
  cleared between train_batch calls;
- LoadMicroBatch: the first stage's input ids ``batch[0].clone().to(device)`` and the last stage's labels
  ``batch[1].to(device)`` go into the slot, each replacing (freeing) what the slot held;
- RecvActivation: at the run's first, the receive buffer (``_recv_tensor_meta``: zeros of the activation's
  shape, kept for the run); each time, its ``.clone()`` into the slot, kept until SendGrad;
- ForwardPass: the slot's input ``.clone()`` runs the stage (the first stage's ids clone is what the embedding
  saves for its backward; a later stage's is the traced step's embedding output, which stands for it); the
  output goes into the slot's ``outputs``, replacing what it held; the last stage then computes the loss;
- RecvGrad: at the run's first, the gradient buffer (``_allocate_or_extend_buffers``: grad_layer, kept);
- BackwardPass: the last stage's ``engine.backward(loss)``, another stage's ``outputs.backward(grad_layer)``,
  whose output slot is then freed (``pipe_buffers['outputs'][buffer_id] = None``); the last stage's outputs
  (its logits) stay in their slot until a later forward replaces them, across the optimizer step too;
- SendGrad: the slot's input let go (``pipe_buffers['inputs'][buffer_id] = None``), with the gradient the
  backward left on it; on the last stage both stay as long as its output does (the output's autograd nodes
  outlive the backward, and the input's AccumulateGrad node holds the input: measured on CPU, two inputs and
  their gradients alive at the step's start);
- ReduceGrads (after the last backward): ZeRO-1's ``reduce_gradients(pipeline_parallel=True)``, stage 0's
  ``allreduce_gradients`` (``_exec_reduce_grads``); OptimizerStep: the wrapper's step.

ZeRO-1 (deepspeed/runtime/zero/stage_1_and_2.py): the gradient hooks run (contiguous_gradients), but off the
boundary they only set up the ipg bucket (setup_buckets, at the step's first hook: reduce_bucket_size elements,
two with overlap_comm); the gradients stay on the parameters, the later micro-batches' added into them;
reduce_gradients(pipeline_parallel=True) appends one more bucket ("with PP we must create ipg buffer, since
backward is handled outside zero"); overlap_comm is off whatever the config says (engine.py
_configure_zero_optimizer disables it for a PipelineModule), takes every gradient into them in module order (zero12_replay.Reducer),
and its epilogue frees the buckets; the step is zero12_replay.optimizer_step_zero12. Measured on CPU (the
harness's PipelineModule of the decoder's own layers, memplan/harness/model_parallel.py): the first backward's
first hook makes the bucket, reduce_gradients the second, both freed together.

Stage 0 (16-bit FP16 wrappers or none): zero12_replay.setup_zero0 and reduce_and_step_zero0.

Under tensor parallelism (is_pipe_partitioned and is_grad_partitioned, DeepSpeed's defaults with a model-parallel
grid; deepspeed/runtime/utils.py PartitionedTensor): a stage's output is kept as its TP rank's part (a clone of
partition_uniform's share) and a LongTensor of meta, the output's own storage swapped for ``zeros(1)``; the next
stage receives the part and the meta (its receive buffers, and meta_buffer, made once), clones them, gathers the
whole activation (full(): a flat buffer all-gathered, then cloned), which replaces them in the slot and is the
stage's input; RecvGrad keeps a part-sized grad_layer, and the backward restores the output whole and gathers
the gradient whole (two more full()); SendGrad partitions the input's gradient. From the source only: the CPU
harness runs no Megatron tensor-parallel layers.

Pure Python, no torch."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memplan.allocator import Allocator, AllocatorConfig
from memplan.parallel import schedules
from memplan.replay import MAX_STEPS, Run, micro_step


def why_not(s: Any) -> str | None:
    """Why this rank's PipelineEngine step cannot be replayed (None: it can): what is not written down yet."""
    st = s.strategy
    if st.zero_stage not in (0, 1):
        return f"ZeRO stage {st.zero_stage} under DeepSpeed's PipelineEngine"
    if s.ds.offload_param or (s.ds.offload_optimizer and st.zero_stage == 0):
        return "ZeRO-Offload of the parameters under DeepSpeed's PipelineEngine is not replayed yet"
    return None


def replay(inv: Any, s: Any, config: AllocatorConfig, x: Any) -> tuple[str, dict[str, Allocator]]:
    """The rank's replay; ``x``: its stage as pipeline_replay._parts makes it (the traced step split, what the
    stage runs of it)."""
    from memplan.frameworks import zero12_replay as z
    from memplan.replay import replay_job
    from memplan.settings import shard_group_size
    from memplan.units import ceil_div

    prof = s.activation_profile
    part = prof.stages[0]
    one = replace(s, activation_profile=part.profile, grad_accum=1)
    st, rc = s.strategy, s.recipe
    trained = [t for t in inv.tensors if t.trainable]
    trainable = tuple(t.trainable for t in inv.tensors) if inv.frozen else None
    if st.zero_stage == 0:
        from memplan.frameworks.zero12 import comm_bytes, fp16_wrapper

        wrapper = fp16_wrapper(s)
        numels = tuple(t.numel for t in trained)
        job = replay_job(inv, one, [sum(numels)]) if wrapper == "fused" else \
            replay_job(inv, one, list(numels), [t.shape for t in trained])
        run, states = z.setup_zero0(job, wrapper, numels, rc.grad_bytes, config, trainable)
        names = {"fused": "FP16_Optimizer", "unfused": "FP16_UnfusedOptimizer", None: "no wrapper"}

        def reduce_and_step(grads: list[tuple[Any, int]], ipg: list[Any], first: bool) -> None:
            z.reduce_and_step_zero0(run, job, wrapper, numels, rc.grad_bytes, comm_bytes(s), grads, states, first)
        _walk(run, s, x, job, reduce_and_step, False)
        return f"DeepSpeed stage 0 ({names[wrapper]}) under DeepSpeed's PipelineEngine (1F1B)", {"": run.a}
    n = shard_group_size(s)
    psi = sum(t.numel for t in trained)
    flat = ceil_div(psi, 2 * n) * 2 * n  # flatten_dense_tensors_aligned(..., 2 * dp_size)
    partition = flat // n
    job = replay_job(inv, one, [partition])
    half, bucket = rc.param_bytes, s.ds.reduce_bucket_size
    norms = z._partition_params(inv, n)

    def zero1(offload: Any) -> Allocator:
        run = z.setup_zero12(job, partition, flat, half, config, offload, trainable)

        def reduce_and_step(grads: list[tuple[Any, int]], ipg: list[Any], first: bool) -> None:
            # reduce_gradients(pipeline_parallel=True): one more bucket, every gradient in module order, then
            # the epilogue's reduce and _release_ipg_buffers; ZeRO-Offload copies each reduced gradient of the
            # rank's partition to the host and steps there (zero12_replay.Offload)
            ipg.append(run.alloc(bucket * half))
            if offload is not None:
                offload.seen, offload.module_order = 0, True
            red = z.Reducer(run, partition, half, bucket, offload)
            red.reduce_all(grads)
            red.flush()
            for k in ipg:
                run.free(k)
            ipg.clear()
            if offload is None:
                z.optimizer_step_zero12(run, job, norms, partition, half, red.grads_flat, first=first)
        _walk(run, s, x, job, reduce_and_step, True)
        return run.a

    name = "ZeRO-1 under DeepSpeed's PipelineEngine (1F1B)"
    if not s.ds.offload_optimizer:
        return name, {"": zero1(None)}
    # ZeRO-Offload: what each reduce copies to the host through the device depends on the rank's part of the
    # flat group: the first part's and the last part's ranks (zero12_replay.replay does the same)
    largest = max((t.numel for t in trained), default=0)
    return "ZeRO-1 Offload under DeepSpeed's PipelineEngine (1F1B)", {
        f"rank {r}": zero1(z.Offload(largest, psi, partition, half, last_rank=r > 0)) for r in (0, n - 1)}


def _walk(run: Run, s: Any, x: Any, job: Any, reduce_and_step: Any, zero1: bool) -> None:
    """The stage's TrainSchedule, train_batch after train_batch until the reserved peak settles."""
    prof = s.activation_profile
    rs, part = prof.actions, prof.stages[0]
    pp, m, rank = rs.pp, rs.micro_batches, rs.rank
    first, last = part.first, part.last
    each = rs.recv_bytes * s.micro_batch  # the activation between stages, and its gradient
    out_bytes = part.output_bytes * s.micro_batch
    # under TP (is_pipe_partitioned, is_grad_partitioned: DeepSpeed's defaults) what crosses stages is each TP
    # rank's part of the activation and of its gradient (PartitionedTensor: partition_uniform's largest part, a
    # clone) with a LongTensor of its meta ([ndims, 3 sizes, parts, rank, tp + 1 offsets]); a stage gathers it
    # whole (PartitionedTensor.full: a flat buffer all-gathered, then its clone)
    parted = rs.tp > 1
    elt = s.recipe.residual_bytes
    part_bytes = -(-(each // elt) // rs.tp) * elt
    meta = 8 * (1 + 3 + 2 + rs.tp + 1)

    def full() -> Any:
        flat = run.alloc(each)
        whole = run.alloc(each)
        run.free(flat)
        return whole

    actions = schedules.rank_actions("1f1b", pp, m, 1, rank)
    slots = max(2, min(pp - rank, m))  # TrainSchedule.num_pipe_buffers
    inputs: list[Any] = [None] * slots
    labels: list[Any] = [None] * slots
    outputs: list[list[Any]] = [[] for _ in range(slots)]
    recv: list[Any] = []
    grad: list[Any] = []
    held: dict[int, list[Any]] = {}  #: per slot, what the last stage's output slot keeps alive with it
    bucket = s.ds.reduce_bucket_size * s.recipe.param_bytes
    # overlap_comm is off for a PipelineModule (engine.py _configure_zero_optimizer: "Pipeline parallelism does not
    # support overlapped communication, will be disabled"; options.py turns it off; measured on CPU with it asked:
    # one bucket at the first hook)
    buffers = 2 if s.ds.overlap_comm else 1
    for step in range(MAX_STEPS):
        before = run.a.peak_reserved
        grads: list[tuple[Any, int]] = []  #: the gradients on the parameters (the step's first backward's)
        ipg: list[Any] = []  #: ZeRO-1's bucket(s), made at the step's first gradient hook

        def on_grad(size: int, key: Any, blk: int) -> bool:
            if zero1 and not ipg:
                ipg.extend(run.alloc(bucket) for _ in range(buffers))  # setup_buckets
            if grads_kept:
                return False  # added into the parameter's gradient: freed where the trace frees it
            grads.append((key, size))
            return True

        grads_kept = False
        clones: dict[int, Any] = {}
        offsets: dict[int, int] = {}
        for _, kind, mb in actions:
            slot = mb % slots
            if kind == schedules.F:
                if first:  # LoadMicroBatch: batch[0].clone().to(device) into the slot
                    ids = run.alloc(job.input_bytes)
                    if inputs[slot] is not None:
                        run.free(inputs[slot])
                    inputs[slot] = ids
                elif not parted:  # RecvActivation: the buffer made once, its .clone() into the slot
                    if not recv:
                        recv.append(run.alloc(each))
                    inputs[slot] = run.alloc(each)
                else:
                    if not recv:  # the meta and the part's buffers, and meta_buffer
                        recv.extend((run.alloc(meta), run.alloc(part_bytes), run.alloc(meta)))
                    got = (run.alloc(meta), run.alloc(part_bytes))
                    # _exec_forward_pass: the slot's tensors cloned, the part gathered whole, which replaces them
                    # in the slot and is the stage's input (the traced step's embedding output then counts it
                    # twice until its first block returns: an over-estimate by one activation there)
                    tmp = (run.alloc(meta), run.alloc(part_bytes))
                    whole = full()
                    for k in (*tmp, *got):
                        run.free(k)
                    inputs[slot] = whole
                if last:  # LoadMicroBatch: batch[1].to(device)
                    lab = run.alloc(job.input_bytes)
                    if labels[slot] is not None:
                        run.free(labels[slot])
                    labels[slot] = lab
                if first:  # _exec_forward_pass: the slot's ids .clone(), saved by the embedding
                    clones[mb] = run.alloc(job.input_bytes)
                offsets[mb] = off = run.offset()
                micro_step(run, job, keep_grads=False, events=x.first, off=off)
                if out_bytes:  # pipe_buffers['outputs'][buffer_id] = outputs
                    # partitioned: the output's part and meta, the output's storage swapped for zeros(1)
                    out = [run.alloc(part_bytes), run.alloc(meta), run.alloc(4)] if parted and not last else \
                        [run.alloc(out_bytes)]
                    for k in outputs[slot] + held.pop(slot, []):
                        run.free(k)
                    outputs[slot] = out
            else:
                if not last and not grad:  # RecvGrad: grad_layer, made once
                    grad.extend((run.alloc(meta), run.alloc(part_bytes)) if parted else (run.alloc(each),))
                whole_grad = None
                if parted and not last:
                    # the output restored whole (output_tensors' .data = part_output.full(), its zeros(1) freed)
                    # and the received gradient gathered whole
                    restored = full()
                    run.free(outputs[slot].pop())
                    outputs[slot].append(restored)
                    whole_grad = full()
                micro_step(run, job, keep_grads=False, on_grad=on_grad, events=x.bwd, off=offsets.pop(mb))
                grads_kept = grads_kept or bool(grads)
                if mb in clones:
                    run.free(clones.pop(mb))
                if not last:
                    for k in outputs[slot]:
                        run.free(k)
                    outputs[slot] = []
                if whole_grad is not None:
                    run.free(whole_grad)
                if not first:  # SendGrad: the slot's input (and the gradient on it) let go
                    if parted:  # the input's gradient partitioned to send (a part and its meta)
                        run.free(run.alloc(part_bytes))
                    if last:
                        # ... but the last stage's output stays in its slot, and with it its autograd graph's
                        # nodes (their saved tensors freed): the input's AccumulateGrad node holds the input, which
                        # holds its gradient (the traced step lets that gradient go at the embedding's backward)
                        held[slot] = [inputs[slot], run.alloc(each)]
                    else:
                        run.free(inputs[slot])
                    inputs[slot] = None
        reduce_and_step(grads, ipg, step == 0)
        run.end_step()
        if step >= 1 and run.a.peak_reserved == before:
            break
