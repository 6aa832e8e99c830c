"""PyTorch DistributedDataParallel (and DDP + ZeroRedundancyOptimizer, plain PyTorch on one GPU, Horovod): the
Reducer's buckets and the gradients autograd keeps to the step (torch/nn/parallel/distributed.py,
torch/csrc/distributed/c10d/reducer.cpp); Horovod's fusion buffer and fp16 compression copies instead of buckets
(horovod/torch/optimizer.py, compression.py; horovod/common/fusion_buffer_manager.cc)."""

from __future__ import annotations

from memplan.frameworks.common import LOSS, FrameworkModel, Grads, Job, unreduced_grad_moments
from memplan.settings import Settings
from memplan.timeline import BufferMoment, BufferTimeline


def buffers(job: Job, grads: Grads) -> BufferTimeline:
    st, rc = job.s.strategy, job.s.recipe
    # the Reducer allocates a flat bucket tensor for every bucket at construction, covering all grads; with
    # gradient_as_bucket_view they are the gradients (whole_step_grads), not counted twice
    view = _as_view(job)
    persistent = rc.grad_bytes * job.psi if st.ddp_buckets and not view else 0
    if st.ddp_buckets and job.inv.unused_params:
        # parameters no loss reads (ParamTensor.unused) need find_unused_parameters=True, and the Reducer buckets
        # every parameter that requires grad (_build_params_for_reducer), so theirs too: bucket bytes no gradient
        # holds, with gradient_as_bucket_view as well (their grads, never made, would have been views of them); it
        # also keeps a device copy of its int32 map of the parameters used (reducer.cpp initialize_local_used_map:
        # local_used_map_dev_)
        persistent += rc.grad_bytes * job.inv.unused_params + 4 * sum(1 for t in job.inv.tensors
                                                                       if t.trainable or t.unused)
    # every parameter's grad is allocated by autograd when produced and kept to the step (the Reducer copies
    # buckets back into them), so inside a block's backward the grads of everything after it exist: the head's
    # inside the last block, all but the embedding's and the first block's inside the first block
    moments = unreduced_grad_moments(job.grad_gathers, rc.grad_bytes, job.psi)
    epilogue, assumptions = 0, {}
    if st.fusion_buffer and job.s.cluster.gpus > 1:
        hv = job.s.horovod
        persistent += hv.fusion_threshold  # torch::empty of the threshold's bytes (torch/adapter_v2.cc), kept
        assumptions["horovod_fusion_buffer"] = hv.fusion_threshold
        if hv.compression == "fp16":
            # every gradient's fp16 copy lives from its hook to synchronize(), which then makes each fp32 result
            # (decompress) before the old gradient goes: at backward's end all copies, plus one tensor's
            copies = [BufferMoment(m.buffers + 2 * m.grads // rc.grad_bytes, m.grads, m.at) for m in moments]
            moments = copies
            g = job.grad_gathers
            epilogue = 2 * job.psi + rc.grad_bytes * max(g.largest_tensor, g.root_largest_tensor)
    if view:
        # each gradient autograd makes is copied into its bucket view by the Reducer's hook (the post-hook of the
        # parameter's AccumulateGrad) and freed: only those whose hook has not run are beside the buckets
        moments = [BufferMoment(m.buffers, 0, m.at) for m in moments]
    return BufferTimeline(persistent=persistent, moments=(LOSS, *moments), end_epilogue=epilogue,
                          assumptions=assumptions, grads_held=view, first_hook_grads_persist=view)


def _as_view(job: Job) -> bool:
    """DDP's gradient_as_bucket_view: each parameter's .grad a view of its Reducer bucket."""
    return job.s.strategy.ddp_buckets and job.s.torch.gradient_as_bucket_view


def whole_step_grads(job: Job) -> int:
    """With gradient_as_bucket_view the Reducer's buckets are the gradients, allocated at construction and kept
    for the run, forward included (reducer.cpp initialize_buckets; mark_variable_ready_dense copies each gradient
    autograd makes into its bucket view, then ``grad = bucket_view``): every gradient's bytes, the whole step.
    zero_grad(set_to_none=True) drops the views, not the buckets. Measured on the CPU harness: the same peak with
    and without it (docs/accuracy.md, "ddp gradient_as_bucket_view")."""
    return job.s.recipe.grad_bytes * job.psi if _as_view(job) else 0


def unreached(s: Settings) -> tuple[str, str]:
    """A parameter no loss reads keeps .grad None, and torch's optimizers make it no state (one GPU; DDP with
    find_unused_parameters, whose Reducer leaves a globally unused parameter's grad untouched: reducer.cpp
    copy_bucket_to_grad); Horovod's synchronize() gives it a zero gradient (horovod/torch/optimizer.py
    _allreduce_grad_async), which the optimizer steps."""
    if s.strategy.fusion_buffer:
        return "trained", "still gradients and optimizer states: Horovod's synchronize() gives each a zero gradient"
    return "tensor", "no gradient and no optimizer state" + (
        " (DDP needs find_unused_parameters=True, and still buckets them)" if s.strategy.ddp_buckets else "")


MODEL = FrameworkModel(name="ddp", replay="memplan.frameworks.ddp_replay", buffers=buffers, unreached=unreached,
                       whole_step_grads=whole_step_grads)
