"""Which dtype setup a recipe is traced in (shared by the cache key and the tracer; no torch here)."""

from __future__ import annotations

#: recipe -> the recipe whose trace it shares: the bf16 recipes compute and keep the residual stream in bf16
#: alike (FSDP's MixedPrecisionPolicy casts the unsharded params and the inputs; DeepSpeed and pure bf16 hold bf16)
_TRACED_AS = {"deepspeed-bf16": "deepspeed-bf16", "fsdp-bf16": "deepspeed-bf16", "pure-bf16": "deepspeed-bf16",
              "deepspeed-fp16": "deepspeed-fp16", "torch-amp": "torch-amp", "fp32": "fp32"}


def trace_recipe(recipe: str) -> str:
    return _TRACED_AS.get(recipe, recipe)
