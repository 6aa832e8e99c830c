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

import functools
from typing import Any

from memplan.activations.tracing_keys import FLOAT8_GATHERED
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
    configs' filter_fqns = ["output"], the output projection: a transformers model's lm_head, as the inventory
    classifies it, model/inventory.py classify "head") or Accelerate's (``first-last``: utils/ao.py
    convert_model_to_fp8_ao filters find_first_last_linear_layers). precision.float8_weights is the same rule on
    the inventory."""
    import torch

    from memplan.model.inventory import classify

    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if keep == "first-last":
        return {linears[0], linears[-1]} if linears else set()
    return {n for n in linears if classify(f"{n}.weight") == "head"}


def convert(model: Any, spec: str, cuda_autocast: bool = False, harness: bool = False) -> int:
    """Swap the model's eligible nn.Linear modules for torchao Float8Linear, in place; the number swapped.
    ``spec``: FLOAT8_KEY's value (tracing_keys.float8_key: the recipe, Accelerate's ``/first-last``, FSDP2's float8
    all-gather). ``harness``: the real run, where FSDP2 does the all-gather (torchao's
    enable_fsdp_float8_all_gather); the trace stands in for it (hand_over). ``cuda_autocast``: the trace's stand-in for CUDA autocast is CPU
    autocast (substitutes.CudaAutocast), so Float8Linear's own cast of its input to CUDA's autocast dtype
    (float8_linear.py forward: ``if torch.is_autocast_enabled(): input = input.to(autocast_dtype)``) is made to
    read it."""
    import torch

    gathered = spec.endswith(FLOAT8_GATHERED)
    recipe, _, keep = spec.removesuffix(FLOAT8_GATHERED).partition("/")
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
    config = f8.Float8LinearConfig.from_recipe_name(recipe)
    if gathered and harness:  # the real thing: FSDP2 all-gathers the weights in float8 (torchao fsdp_utils.py)
        from dataclasses import replace

        config = replace(config, enable_fsdp_float8_all_gather=True)
    f8.convert_to_float8_training(model, module_filter_fn=eligible, config=config)
    from torchao.float8.float8_linear import Float8Linear

    for m in model.modules():
        if not isinstance(m, Float8Linear) or harness:
            continue
        if gathered:
            _gathered_weight(m)
        if cuda_autocast or gathered:
            m.forward = _forward(m, cuda_autocast, gathered)
    return len(names)


def _gathered_weight(mod: Any) -> None:
    """FSDP2's float8 all-gather in the trace: the unsharded weight a Float8Linear reads is already float8
    (torchao fsdp_utils.py WeightWithDynamicFloat8CastTensor: fsdp_pre_all_gather casts the shard, and
    fsdp_post_all_gather wraps the gathered bytes in a Float8TrainingTensor of param_dtype), so its forward and
    backward cast no weight. The gathered bytes are FSDP2's unsharded parameter, which the strategy counts: here
    they are a buffer made before the step (the trace ignores buffers), wrapped at each forward."""
    import torch

    mod.register_buffer("memplan_float8_weight", torch.empty(mod.weight.shape, dtype=torch.float8_e4m3fn,
                                                             device=mod.weight.device), persistent=False)
    mod.register_buffer("memplan_float8_scale", torch.empty((), dtype=torch.float32, device=mod.weight.device),
                        persistent=False)


def _forward(mod: Any, cuda_autocast: bool, gathered: bool) -> Any:
    """Float8Linear.forward (float8_linear.py) as the trace runs it: its input cast to CUDA's autocast dtype where
    the trace's CUDA autocast is CPU autocast (substitutes.CudaAutocast), and its weight the float8 one FSDP2
    gathered where it gathers in float8."""
    import torch
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    hand = _gathered() if gathered else None

    def run(x: Any) -> Any:
        if cuda_autocast and torch.is_autocast_enabled("cpu"):  # CUDA's autocast in the trace
            x = x.to(torch.get_autocast_dtype("cpu"))
        w = mod.weight
        if hand is not None:  # handed over by the block's pre-hook (hand_over), else made here
            w = getattr(mod, "memplan_handed", None)
            if w is None:
                w = hand.apply(mod.weight, mod.memplan_float8_weight, mod.memplan_float8_scale, mod.linear_mm_config)
        out = matmul_with_hp_or_float8_args.apply(x, w.t(), mod.linear_mm_config, mod.config)
        if mod.bias is not None:
            out = out + mod.bias.to(out.dtype)
        return out

    return run


def hand_over(blocks: list[Any]) -> None:
    """FSDP2 unshards a block in its pre-forward hook, outside a compiled block's graph: the float8 weights it
    gathered reach the graph as inputs (AOTAutograd flattens the Float8TrainingTensor into its data and scale), as
    here, where each block's pre-hook hands its linears theirs."""
    from torchao.float8.float8_linear import Float8Linear

    hand = _gathered()
    for blk in blocks:
        mods = [m for m in blk.modules() if isinstance(m, Float8Linear) and hasattr(m, "memplan_float8_weight")]
        if not mods:
            continue

        def pre(_mod: Any, _args: Any, mods: list[Any] = mods) -> None:
            for m in mods:
                m.memplan_handed = hand.apply(m.weight, m.memplan_float8_weight, m.memplan_float8_scale,
                                              m.linear_mm_config)

        blk.register_forward_pre_hook(pre)


@functools.lru_cache(maxsize=1)
def _gathered() -> Any:
    """An autograd function: the weight as FSDP2's float8 all-gather hands it over (a Float8TrainingTensor over the
    gathered bytes), its gradient passed to the parameter as FSDP2's unsharded parameter receives it."""
    import torch
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    class Gathered(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, weight: Any, data: Any, scale: Any, mm_config: Any) -> Any:  # noqa: ARG004
            return Float8TrainingTensor(data, scale, weight.dtype, mm_config, gemm_input_role=GemmInputRole.WEIGHT)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:  # noqa: ARG004
            return grad, None, None, None

    return Gathered
