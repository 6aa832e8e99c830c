"""torchao float8 training, in the traced step and in the harness alike: each eligible nn.Linear swapped for torchao's
Float8Linear as torchtitan's float8 converter does it (or Accelerate's torchao backend: ``/first-last``).

torchtitan (components/quantization/float8.py Float8LinearConverter, utils.py module_filter_fn) converts every
nn.Linear whose weight's two dims are multiples of 16 (torch._scaled_mm's requirement), except the modules its
configs filter: ``filter_fqns = ["output"]``, the output projection (a transformers model's lm_head). The recipe is
torchao's (float8/config.py Float8LinearConfig.from_recipe_name): tensorwise, rowwise or rowwise_with_gw_hp.

What a Float8Linear allocates is torchao's own code (float8/float8_linear.py matmul_with_hp_or_float8_args), run on
the trace's fake tensors: it saves its high-precision input and weight for backward, and casts each operand of
each of its three GEMMs to float8 when it needs it (float8_scaling_utils.hp_tensor_to_float8_dynamic: abs, amax,
an fp32 copy scaled and clamped, then float8), with torch._scaled_mm's operand layout copies (float8_ops.py
preprocess_addmm). Its operators on torchao's tensor subclass are followed through (tracing/live.py).
"""

from __future__ import annotations

from typing import Any

from memplan.errors import SettingsError

#: the torchao the float8 path is modelled on and checked with (pyproject's extras pin it)
TORCHAO = "torchao>=0.18"


def available() -> bool:
    from importlib.util import find_spec

    return find_spec("torchao") is not None


def torchao_float8() -> Any:
    """torchao.float8, imported quietly; a one-line SettingsError when torchao is not installed."""
    if not available():
        raise SettingsError(f"float8 training is torchao's Float8Linear: install torchao ({TORCHAO})")
    from memplan import progress

    progress.quiet_imports()
    import torchao.float8 as f8

    return f8


def kept(model: Any, keep: str) -> set[str]:
    """The names of the nn.Linear modules the converter leaves in high precision: torchtitan's (``output``: its
    configs' filter_fqns = ["output"], the output projection, a transformers model's get_output_embeddings()) or
    Accelerate's (``first-last``: utils/ao.py convert_model_to_fp8_ao filters find_first_last_linear_layers)."""
    import torch

    if keep == "first-last":
        linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        return {linears[0], linears[-1]} if linears else set()
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    return {n for n, m in model.named_modules() if out is not None and m is out}


def convert(model: Any, spec: str, cuda_autocast: bool = False) -> int:
    """Swap the model's eligible nn.Linear modules for torchao Float8Linear, in place; the number swapped.
    ``spec``: the recipe (tensorwise, rowwise, rowwise_with_gw_hp), then ``/first-last`` for Accelerate's choice
    of the linears kept (tracing_keys.FLOAT8_KEY). ``cuda_autocast``: the trace's stand-in for CUDA autocast is CPU
    autocast (substitutes.CudaAutocast), so Float8Linear's own cast of its input to CUDA's autocast dtype
    (float8_linear.py forward: ``if torch.is_autocast_enabled(): input = input.to(autocast_dtype)``) is made to
    read it."""
    import torch

    recipe, _, keep = spec.partition("/")
    f8 = torchao_float8()
    skip = kept(model, keep or "output")

    def eligible(mod: Any, fqn: str) -> bool:
        w = getattr(mod, "weight", None)
        return (isinstance(mod, torch.nn.Linear) and w is not None and w.shape[0] % 16 == 0
                and w.shape[1] % 16 == 0 and fqn not in skip)

    names = [n for n, m in model.named_modules() if eligible(m, n)]
    if not names:
        raise SettingsError("float8 training: the model has no nn.Linear whose dims are multiples of 16 besides "
                            "those the converter keeps in bf16 (torchao's Float8Linear swaps nn.Linear only)")
    f8.convert_to_float8_training(model, module_filter_fn=eligible, config=f8.Float8LinearConfig.from_recipe_name(recipe))
    if cuda_autocast:
        from torchao.float8.float8_linear import Float8Linear

        for m in model.modules():
            if isinstance(m, Float8Linear):
                m.forward = _cuda_autocast_forward(m)
    return len(names)


def _cuda_autocast_forward(mod: Any) -> Any:
    import torch

    forward = type(mod).forward

    def run(x: Any) -> Any:
        if torch.is_autocast_enabled("cpu"):  # CUDA's autocast in the trace (substitutes.CudaAutocast)
            x = x.to(torch.get_autocast_dtype("cpu"))
        return forward(mod, x)

    return run
