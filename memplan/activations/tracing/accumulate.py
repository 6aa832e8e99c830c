"""Gradient accumulation as the real autograd engine does it, on the fake tensors the step is traced with.

When a tensor's gradient has several contributions, the engine adds each new one into the input buffer of the
node that will consume it (torch/csrc/autograd/input_buffer.cpp, ``accumulate``): in place,
``old_var.add_(var)``, when it holds the only reference to the first one and to its storage and that tensor is
dense (``can_accumulate_inplace``: ``is_non_overlapping_and_dense``, ``impl::is_tensor_stealable``, storage
``use_count() == 1``), out of place, ``old_var + var``, otherwise. A fake tensor is a tensor subclass, which the
engine never steals, so a fake trace would allocate a new tensor at every accumulation that a real run does in
place: a transient the size of the gradient (phi-2's MLP input and rotary halves, a residual stream's branch),
which the GPU's allocator stream does not show (bench/gpu/traces/phi2_ddp_fp32).

``Accumulations`` makes the engine's own choice on the fake tensors. The engine's adds are told from a node's
own by what they add to: a first contribution made before the node now running began (a node's pre-hook marks
where each begins; post-hooks are not used: the engine keeps a node's inputs alive for them, which would change
the step), outside AccumulateGrad (a parameter's ``.grad``, accumulated by its own rules). The reference counts
compared are the ones a uniquely held gradient shows inside the dispatch mode, measured once per trace
(``calibrate``): the dispatcher's own references to the arguments are the same for every call.
"""

from __future__ import annotations

from typing import Any


class Accumulations:
    def __init__(self) -> None:
        self.active = False  #: the backward is running (hook)
        self.node_start = 0  #: births before the node now running began
        self.tensor_refs: int | None = None  #: _use_count() of a uniquely held gradient inside the mode
        self.storage_refs: int | None = None  #: the use count of its storage, seen the same way
        self.probing = False
        self.inplace = 0  #: accumulations done in place (for the record)
        self._live: Any = None

    def hook(self, loss: Any, live: Any) -> None:
        """A pre-hook on every node of ``loss``'s graph but the AccumulateGrad leaves: where each node begins."""
        self._live = live
        seen: set[Any] = set()
        stack = [loss.grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen or hasattr(fn, "variable"):
                continue
            seen.add(fn)
            fn.register_prehook(self._enter)
            stack.extend(nxt for nxt, _ in fn.next_functions)
        self.active = True

    def _enter(self, *_: Any) -> None:
        self.node_start = len(self._live._births_list)

    def calibrate(self, mode: Any, live: Any) -> None:
        """The counts of a uniquely held first contribution, seen from ``mode`` (a fresh dispatch mode of the
        kind the trace runs under, following ``live``): y = x * 1; (y * 2 + y * 3).sum() accumulates y's two
        gradients, the first of which only y's input buffer holds."""
        import torch

        x = torch.ones(4, 4, requires_grad=True)
        y = x * 1
        loss = (y * 2 + y * 3).sum()
        self.probing = True
        with mode:
            self.hook(loss, live)
            try:
                loss.backward()
            finally:
                self.probing = False
                self.active = False

    def maybe_inplace(self, func: Any, args: tuple, kwargs: dict, live: Any) -> Any:
        """The engine's accumulation of ``args``, in place where the real engine would do it; None where the
        op is something else (or an accumulation to do out of place)."""
        import torch

        if not self.active or func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2:
            return None
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old.shape != new.shape \
                or old.dtype != new.dtype or old.layout != torch.strided:
            return None
        sid = live._sid.get(id(old.untyped_storage()))
        if sid is None or sid >= self.node_start:
            return None  # made by the node now running: its own add
        node = torch._C._current_autograd_node()
        if node is None or hasattr(node, "variable"):
            return None  # AccumulateGrad's own accumulation into a parameter's .grad
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
