"""Gradient accumulation as the real autograd engine does it, on the fake tensors the step is traced with.

When a tensor's gradient has several contributions, the engine adds each new one into the input buffer of the
node that will consume it (torch/csrc/autograd/input_buffer.cpp, ``accumulate``): in place,
``old_var.add_(var)``, when it holds the only reference to the first one and to its storage and that tensor is
dense (``can_accumulate_inplace``: ``is_non_overlapping_and_dense``, ``impl::is_tensor_stealable``, storage
``use_count() == 1``), out of place, ``old_var + var``, otherwise. A fake tensor is a tensor subclass, which the
engine never steals, so a fake trace would allocate a new tensor at every accumulation that a real run does in
place: a transient the size of the gradient (phi-2's MLP input and rotary halves, a residual stream's branch),
which the GPU's allocator stream does not show (bench/gpu/traces/phi2_ddp_fp32).

``Accumulations`` makes the engine's own choice on the fake tensors: the adds made between two nodes (the
engine's ``InputBuffer::add``: after a node's post-hooks, before the next node's pre-hooks) are redone in place
where the real engine would. The reference counts it compares are the ones a tensor shows inside the
dispatch mode for one uniquely held gradient, measured once per trace (``calibrate``): the dispatcher's own
references to the arguments are the same for every call.
"""

from __future__ import annotations

from typing import Any


class Accumulations:
    def __init__(self) -> None:
        self.between = False  #: the engine is between two nodes (distributing a node's outputs)
        self.tensor_refs: int | None = None  #: _use_count() of a uniquely held gradient inside the mode
        self.storage_refs: int | None = None  #: the use count of its storage, seen the same way
        self.probing = False
        self.inplace = 0  #: accumulations done in place (for the record)

    def hook(self, loss: Any) -> None:
        """Pre- and post-hooks on every node of ``loss``'s graph: the adds made between them are the engine's."""
        seen: set[Any] = set()
        stack = [loss.grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            fn.register_prehook(self._enter)
            fn.register_hook(self._leave)
            stack.extend(nxt for nxt, _ in fn.next_functions)
        self.between = True

    def _enter(self, *_: Any) -> None:
        self.between = False

    def _leave(self, *_: Any) -> None:
        self.between = True

    def calibrate(self, mode: Any) -> None:
        """The counts of a uniquely held first contribution, seen from ``mode`` (a fresh dispatch mode of the
        kind the trace runs under): y = x * 1; (y * 2 + y * 3).sum() accumulates y's two gradients, the first of
        which only y's input buffer holds."""
        import torch

        x = torch.ones(4, 4, requires_grad=True)
        y = x * 1
        loss = (y * 2 + y * 3).sum()
        self.probing = True
        self.hook(loss)
        try:
            with mode:
                loss.backward()
        finally:
            self.probing = False
            self.between = False

    def maybe_inplace(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The engine's accumulation of ``args``, in place where the real engine would do it; None where the
        op is something else (or an accumulation to do out of place)."""
        import torch

        if not self.between or func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2:
            return None
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old.shape != new.shape \
                or old.dtype != new.dtype or old.layout != torch.strided:
            return None
        refs = old._use_count()
        storage_refs = torch._C._storage_Use_Count(old.untyped_storage()._cdata)
        if self.probing:
            self.tensor_refs, self.storage_refs = refs, storage_refs
            return None
        if self.tensor_refs is None or refs > self.tensor_refs or storage_refs > self.storage_refs:
            return None
        from torch._prims_common import is_non_overlapping_and_dense_or_false

        if not is_non_overlapping_and_dense_or_false(old):
            return None
        self.inplace += 1
        return torch.ops.aten.add_.Tensor(old, new)
