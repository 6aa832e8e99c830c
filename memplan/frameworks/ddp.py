"""PyTorch DistributedDataParallel (and DDP + ZeroRedundancyOptimizer): the Reducer's buckets and the gradients
autograd keeps to the step (torch/nn/parallel/distributed.py, torch/csrc/distributed/c10d/reducer.cpp)."""

from __future__ import annotations

from memplan.frameworks.common import LOSS, FrameworkModel, Grads, Job, unreduced_grad_moments
from memplan.timeline import BufferTimeline


def buffers(job: Job, grads: Grads) -> BufferTimeline:
    st, rc = job.s.strategy, job.s.recipe
    # the Reducer allocates a flat bucket tensor for every bucket at construction, covering all grads (none
    # with gradient_as_bucket_view: the grads are views into the buckets)
    persistent = rc.grad_bytes * job.psi if st.ddp_buckets and not job.s.torch.gradient_as_bucket_view else 0
    # every parameter's grad is allocated by autograd when produced and kept to the step (the Reducer copies
    # buckets back into them), so inside a block's backward the grads of everything after it exist: the head's
    # inside the last block, all but the embedding's and the first block's inside the first block
    return BufferTimeline(persistent=persistent,
                          moments=(LOSS, *unreduced_grad_moments(job.gathers, rc.grad_bytes, job.psi)))


MODEL = FrameworkModel(name="ddp", replay="memplan.frameworks.ddp_replay", buffers=buffers)
