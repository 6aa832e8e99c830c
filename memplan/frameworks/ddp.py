"""PyTorch DistributedDataParallel (and DDP + ZeroRedundancyOptimizer, plain PyTorch on one GPU, Horovod): the
Reducer's buckets and the gradients autograd keeps to the step (torch/nn/parallel/distributed.py,
torch/csrc/distributed/c10d/reducer.cpp); Horovod's fusion buffer and fp16 compression copies instead of buckets
(horovod/torch/optimizer.py, compression.py; horovod/common/fusion_buffer_manager.cc)."""

from __future__ import annotations

from memplan.frameworks.common import LOSS, FrameworkModel, Grads, Job, unreduced_grad_moments
from memplan.timeline import BufferMoment, BufferTimeline


def buffers(job: Job, grads: Grads) -> BufferTimeline:
    st, rc = job.s.strategy, job.s.recipe
    # the Reducer allocates a flat bucket tensor for every bucket at construction, covering all grads (none
    # with gradient_as_bucket_view: the grads are views into the buckets)
    persistent = rc.grad_bytes * job.psi if st.ddp_buckets and not job.s.torch.gradient_as_bucket_view else 0
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
    return BufferTimeline(persistent=persistent, moments=(LOSS, *moments), end_epilogue=epilogue,
                          assumptions=assumptions)


MODEL = FrameworkModel(name="ddp", replay="memplan.frameworks.ddp_replay", buffers=buffers)
