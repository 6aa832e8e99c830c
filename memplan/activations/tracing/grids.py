"""The values a Qwen-VL step reads from its inputs, kept through the fake-tensor trace.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL build shapes from the values of their inputs (transformers 5.24):

- the vision tower's rotary positions and attention segments from ``image_grid_thw``
  (transformers/vision_utils.py get_vision_position_ids: ``grid_thw.tolist()``; get_vision_cu_seqlens), each
  segment's own attention (modeling_qwen2_5_vl.py Qwen2_5_VLVisionAttention: ``torch.split(..., lengths.tolist())``,
  one SDPA per image, or per window), the features' split per image (get_image_features: ``.tolist()``);
- Qwen2.5-VL's windows (vision_utils.py get_vision_window_index: a boolean index, ``index_padded != -100``);
- the language model's 3-D rotary positions from ``input_ids`` and ``mm_token_type_ids``
  (Qwen2_5_VLModel.get_rope_index: ``itertools.groupby(input_token_type.tolist())`` and a tensor of per-sample
  deltas).

Fake tensors have no values (a ``.tolist()`` on one raises DataDependentOutputException). FakeTensorMode keeps a
tensor's real value beside it where it can (FakeTensor.constant) and propagates it through an operator all of whose
inputs carry one, for outputs of at most CONSTANT_NUMEL_LIMIT elements (torch/_subclasses/fake_tensor.py
_dispatch_impl, may_turn_const). The step's token ids and grid are made with torch.tensor (model/tasks.py
_patch_grid_inputs), which fake mode lifts into such constants; here the limit is lifted for the step, so that what
is computed from them carries its value too. The model's own parameters and activations are never constants (their
fake tensors are made without values), so nothing else changes.

Each image's (or window's) attention is its own SDPA call (torch.split of q, k and v at the segments' lengths, one
call per segment, torch.cat of the outputs): the step's operations grow with its images, and a profile is the same
operations traced at two micro-batches (tracing/fit.py). The trace runs the segments that sit at the same place in
each image together instead: q, k and v viewed as [images, ...] (unflatten), one torch.split at one image's
segments (its backward, one torch.cat of the gradients, as the model's own split's), one call per segment of an
image with the images as its batch, and one torch.cat of those outputs, the same [1, tokens, heads, head_dim] as
the model's. Every tensor the model's loop makes is there, n of them as one of n times the size (the allocator's
per-tensor rounding aside; a math-kernel call's own temporaries are n times one call's).

Two functions build index tensors from factories (torch.arange) and read them back (a boolean index, a tensor of
tensors): get_vision_window_index and each model's get_rope_index. Those run on the inputs' real values with the
fake and tracking modes off, and hand back outputs made under the modes (so each is a birth on the timeline, where
the model makes it) that carry their values. Their temporaries (a few index tensors of the image's or the
sequence's length, freed before the function returns) are not counted. On CUDA, get_vision_window_index makes its
window index on the CPU (torch.arange without a device) and each indexing with it copies it to the GPU for the
operator; the trace counts it as one device tensor of the merged tokens' length (8 bytes each: 10 KB for a 980 px
image), a bound on those copies. No torch at import.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Iterator
from typing import Any

from memplan.model import tasks


def reads_values(config: dict[str, Any]) -> bool:
    """Whether the config's step reads its inputs' values (a patch-grid vision-language model)."""
    return tasks.task_of(config) == tasks.IMAGE_TEXT and config.get("model_type") in tasks.PATCH_GRID_MODELS


def reads_ids(config: dict[str, Any]) -> bool:
    """Whether the config's step reads its token ids' and labels' values (an encoder's head; XLM and FlauBERT
    take each sequence's length from its ids, ``lengths.max().item()``): a sequence classifier pools at each
    sequence's last EOS (BART, T5: a boolean index of the EOS mask, its count per sequence checked with
    torch.unique_consecutive) or last non-padding token, and DeBERTa's loss indexes the labels that are not
    negative (nonzero): each an output whose size is the values'. The step's ids and labels are made with
    torch.tensor (model/tasks.py step_inputs) and what is computed from them alone carries its value."""
    return tasks.task_of(config) in ("sequence-classification", "masked-lm", "token-classification",
                                     "question-answering")


def reads_mask(config: dict[str, Any]) -> bool:
    """Whether the config's step reads its attention mask's values (model/tasks.py MASK_VALUE_MODELS: Longformer's
    and LED's global tokens). The mask is fed as a constant; transformers' create_bidirectional_mask (masking_utils:
    the mask function vmapped over index tensors made by torch.arange, which carry no values) and the attention's
    _get_global_attn_indices (a ``nonzero`` of the global tokens) run on the values (_on_values), the model's own
    operations between them (``attention_mask < 0``, ``> 0``, the clamp, the inverted 4-D mask) on constants."""
    return config.get("model_type") in tasks.MASK_VALUE_MODELS


@contextlib.contextmanager
def constant_inputs(config: dict[str, Any]) -> Iterator[None]:
    """Keep the step's input values through the trace (see the module's docstring); nothing for other configs."""
    import torch._subclasses.fake_tensor as ft

    if not (reads_mask(config) or reads_ids(config) or reads_values(config)):
        yield
        return
    # (owner, name, the replacement) for the step: what runs on the values, and for a patch-grid model the vision
    # attention run by segment slot
    patched = _value_patches(config) if reads_mask(config) or reads_values(config) else []
    real = [(owner, name, vars(owner)[name]) for owner, name, _ in patched]
    limit = ft.CONSTANT_NUMEL_LIMIT
    try:
        ft.CONSTANT_NUMEL_LIMIT = sys.maxsize
        for owner, name, new in patched:
            setattr(owner, name, new)
        yield
    finally:
        ft.CONSTANT_NUMEL_LIMIT = limit
        for owner, name, old in real:
            setattr(owner, name, old)


def _value_patches(config: dict[str, Any]) -> list[tuple[Any, str, Any]]:
    """The functions of the config's modeling module that a trace runs on its inputs' values (reads_mask,
    reads_values), each as (owner, name, replacement)."""
    import inspect

    import torch.nn as nn

    mt = str(config["model_type"])
    module = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    classes = [c for c in vars(module).values() if isinstance(c, type)]
    if reads_mask(config):
        out: list[tuple[Any, str, Any]] = []
        if hasattr(module, "create_bidirectional_mask"):  # reads only the shapes of the embeddings it is given
            out.append((module, "create_bidirectional_mask",
                        _on_values(module.create_bidirectional_mask, shapes_only=True)))
        out += [(c, "_get_global_attn_indices", staticmethod(_on_values(vars(c)["_get_global_attn_indices"].__func__)))
                for c in classes if isinstance(vars(c).get("_get_global_attn_indices"), staticmethod)]
        return out
    # run on the values: the vision_utils helpers the module calls (standalone functions of the grid and config
    # scalars: positions, segments, windows) and each model's get_rope_index
    out = [(module, n, _on_values(f)) for n, f in vars(module).items()
           if n.startswith("get_vision_") and getattr(f, "__module__", "") == "transformers.vision_utils"]
    out += [(c, "get_rope_index", _on_values(vars(c)["get_rope_index"])) for c in classes
            if "get_rope_index" in vars(c)]
    # by segment slot: the vision tower's attention, a module whose forward takes cu_seqlens (not the blocks that
    # pass it on)
    out += [(c, "forward", _by_segment_slot(vars(c)["forward"])) for c in classes
            if issubclass(c, nn.Module) and "Attention" in c.__name__ and "forward" in vars(c)
            and "cu_seqlens" in inspect.signature(c.forward).parameters]
    return out


def _on_values(fn: Any, shapes_only: bool = False) -> Any:
    """``fn`` run on its arguments' values, modes off; its tensors handed back as births under the modes, each
    carrying its value. ``shapes_only``: a tensor argument without a value is given as an uninitialised one of its
    shape and dtype (for a function that reads only those of it)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils._pytree import tree_map

    def value(x: Any) -> Any:
        if isinstance(x, FakeTensor):
            if x.constant is None and shapes_only:
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
            if x.constant is None:
                raise ValueError(f"{fn.__qualname__} reads the values of a tensor the trace has none for")
            return x.constant
        return x

    def born(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor):
            out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
            out.constant = x
            return out
        return x

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            args, kwargs = tree_map(value, args), tree_map(value, kwargs)
            out = fn(*args, **kwargs)
        return tree_map(born, out)

    return run


def segment_period(lengths: list[int]) -> int:
    """The fewest leading segments that the lengths repeat (one image's, or fewer where its own repeat)."""
    n = len(lengths)
    return next(p for p in range(1, n + 1) if n % p == 0 and lengths == lengths[:p] * (n // p))


def _by_segment_slot(forward: Any) -> Any:
    """The vision attention's forward with its per-segment loop run one call per segment slot (see the module's
    docstring): torch.split and torch.cat are the model's own but for the one split at the segments' lengths and
    the cat of the outputs that follows it."""
    import torch

    @functools.wraps(forward)
    def run(self: Any, hidden_states: Any, cu_seqlens: Any, *args: Any, **kwargs: Any) -> Any:
        cu = getattr(cu_seqlens, "constant", None)
        if cu is None:
            return forward(self, hidden_states, cu_seqlens, *args, **kwargs)
        bounds = [int(x) for x in cu.tolist()]
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        if not lengths:
            return forward(self, hidden_states, cu_seqlens, *args, **kwargs)
        slot = lengths[:segment_period(lengths)]
        reps = len(lengths) // len(slot)
        real_split, real_cat = torch.split, torch.cat
        split_done = [False]

        def split(tensor: Any, sizes: Any, dim: int = 0) -> Any:
            if dim == 2 and isinstance(sizes, list) and sizes == lengths and tensor.dim() == 4 and tensor.shape[0] == 1:
                split_done[0] = True
                parts = real_split(tensor.unflatten(2, (reps, sum(slot))), slot, dim=3)
                return tuple(p.squeeze(0).transpose(0, 1) for p in parts)  # [images, heads, segment, head_dim]
            return real_split(tensor, sizes, dim)

        def cat(tensors: Any, dim: int = 0, **kw: Any) -> Any:
            if split_done[0] and dim == 1 and not kw and len(tensors) == len(slot) \
                    and all(t.dim() == 4 and t.shape[0] == reps and t.shape[1] == n for t, n in zip(tensors, slot)):
                split_done[0] = False
                return real_cat(tensors, dim=1).flatten(0, 1).unsqueeze(0)  # [1, tokens, heads, head_dim]
            return real_cat(tensors, dim, **kw)

        torch.split, torch.cat = split, cat
        try:
            return forward(self, hidden_states, cu_seqlens, *args, **kwargs)
        finally:
            torch.split, torch.cat = real_split, real_cat

    return run
