"""Which dtype setup a recipe is traced in (shared by the cache key and the tracer; no torch here)."""

from __future__ import annotations

#: recipe -> the recipe whose trace it shares (same compute dtype, residual dtype and autocast behaviour)
_SAME_TRACE = {"deepspeed-bf16": "bf16", "fsdp-bf16": "bf16", "pure-bf16": "bf16", "deepspeed-fp16": "fp16",
               "torch-amp": "torch-amp", "fp32": "fp32"}


def trace_recipe(recipe: str) -> str:
    return {"bf16": "deepspeed-bf16", "fp16": "deepspeed-fp16"}.get(_SAME_TRACE.get(recipe, recipe),
                                                                   _SAME_TRACE.get(recipe, recipe))
