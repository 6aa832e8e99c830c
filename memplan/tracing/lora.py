"""LoRA in the traced step: the same adapters memplan/model/lora.py puts in the inventory, added to the module
the trace runs, with PEFT's forward (peft 0.21, peft/tuners/lora/layer.py Linear.forward):

    result = self.base_layer(x)
    x = self._cast_input_dtype(x, lora_A.weight.dtype)      # a copy only where the dtypes differ
    result = result + lora_B(lora_A(dropout(x))) * scaling
    result = result.to(torch_result_dtype)

so what autograd saves is what PEFT's layers save: a frozen base linear keeps only what its input's gradient
needs (no copy of its input for a weight gradient), the adapters keep their inputs, dropout its mask. Every base
parameter is frozen as PEFT freezes it (_mark_only_adapters_as_trainable), with the bias and modules_to_save
rules of the spec. The harness runs PEFT itself, which is how this stand-in is checked (docs/accuracy.md).
"""

from __future__ import annotations

import re
from typing import Any

from memplan.model.lora import LoraSpec, resolve_targets


def _layer_kind(m: Any) -> str:
    from memplan.model.meta_builder import _layer_kind as kind

    return kind(m)


def _module_class() -> Any:
    import torch
    from torch import nn

    class LoraLinear(nn.Module):
        """peft.tuners.lora.Linear's forward for one adapter (named "default", as PEFT names it)."""

        def __init__(self, base: nn.Module, r: int, dropout: float, scaling: float, conv1d: bool) -> None:
            super().__init__()
            self.base_layer = base
            w = base.weight
            fan_in, fan_out = (w.shape[0], w.shape[1]) if conv1d else (w.shape[1], w.shape[0])
            self.lora_dropout = nn.Dropout(p=dropout) if dropout > 0 else nn.Identity()
            self.lora_A = nn.Linear(fan_in, r, bias=False, dtype=w.dtype)
            self.lora_B = nn.Linear(r, fan_out, bias=False, dtype=w.dtype)
            self.scaling = scaling

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            result = self.base_layer(x, *args, **kwargs)
            torch_result_dtype = result.dtype
            if x.dtype != self.lora_A.weight.dtype:
                x = x.to(dtype=self.lora_A.weight.dtype)
            result = result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
            return result.to(torch_result_dtype)

    return LoraLinear


def inject(model: Any, fields: dict[str, Any], family: str) -> int:
    """Add the adapters to ``model`` in place and freeze what PEFT freezes; the number of adapted layers."""
    spec = LoraSpec.from_trace_fields(fields)
    owners = [(name, _layer_kind(m)) for name, m in model.named_modules()
              if any(True for _ in m.parameters(recurse=False))]
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out_name = next((n for n, m in model.named_modules() if m is out_emb), None) if out_emb is not None else None
    chosen = resolve_targets(spec, owners, family, out_name)
    save = spec.modules_to_save
    for p in model.parameters():
        p.requires_grad_(False)
    for name, m in model.named_modules():  # biases PEFT leaves trainable, and modules_to_save (trained whole)
        if save and any(re.match(rf"(^|.*\.){k}($|\..*)", name) for k in save):
            for p in m.parameters():
                p.requires_grad_(True)
        bias = getattr(m, "bias", None)
        if bias is not None and hasattr(bias, "requires_grad_") and (
                spec.bias == "all" or (spec.bias == "lora_only" and name in chosen)):
            bias.requires_grad_(True)
    cls = _module_class()
    modules = dict(model.named_modules())
    for name in chosen:
        parent_name, _, leaf = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        base = modules[name]
        r = spec.rank
        for key, rank in spec.rank_pattern:
            if name == key or name.endswith("." + key) or re.fullmatch(rf"(.*\.)?{key}", name):
                r = rank
                break
        setattr(parent, leaf, cls(base, r, spec.dropout, 1.0, _layer_kind(base) == "conv1d"))
    return len(chosen)
