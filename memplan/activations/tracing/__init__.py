"""Activation bytes measured from the real module: transformers' modeling code run on the ``meta`` device.

For a config, the model is built under ``FakeTensorMode`` (meta storage, CPU dispatch, so autocast applies)
at its real size and depth, and one training micro-step (forward, loss, backward) is run at the job's sequence
length for micro-batch 2 and 4. Two instruments watch it:

* ``torch.autograd.graph.saved_tensors_hooks``: the bytes autograd saves for backward, deduplicated by storage,
  parameters excluded;
* a ``TorchDispatchMode`` that follows every storage the step creates until it dies (meta storages keep their
  Python object, so a weakref callback marks the free): the live bytes after forward, and the peaks in forward
  and backward. Parameter gradients are dropped as soon as they are accumulated (the strategy accounts for
  them), so the backward peak is activations and transients only.

Kernels: the step runs on fake CPU tensors, and where the target device (``kernels.Target``) runs something
else the trace runs a stand-in (``memplan/activations/substitutes.py``): each SDPA call takes the backend the device's own
rules choose (``memplan/activations/kernels.py``: CUDA's cuDNN / flash / memory-efficient / math, CPU's flash / math), a
fused backend saving and allocating what it does on the device, math running PyTorch's composite; a GPU job
runs CUDA's autocast policy (taken from the installed PyTorch's AutocastCUDA kernels), CUDA's fused dropout,
and counts every storage in the caching allocator's 512-byte blocks; a CPU job adds oneDNN's GEMM scratch for
its instruction set. The profile records which attention kernels ran and why (``attention_kernels``).
``eager`` runs transformers' eager attention as written.

Recompute ``full`` runs with ``gradient_checkpointing_enable(use_reentrant=False)``: what is live after forward
is then the block inputs, and the backward peak includes one block recomputed.

Every point of the timeline is a line c0 + c1*b in the micro-batch; the profile keeps the upper envelope of
the forward and backward timelines, so a peak at any micro-batch is exact, wherever in the step it falls (the
loss for a large vocabulary, a tied embedding's gradient, a recomputed block). Profiles are cached on disk
(see ``profile_cache.py``).

Modules: ``live`` (the live bytes, op by op), ``step`` (one traced micro-step), ``segments`` (the timeline
read at the step's moments), ``fit`` (lines in the micro-batch, the profile).
"""

from __future__ import annotations

from memplan.activations.profile_fit import GRAD_WIDTHS
from memplan.activations.tracing.fit import trace_profile

__all__ = ["GRAD_WIDTHS", "trace_profile"]
