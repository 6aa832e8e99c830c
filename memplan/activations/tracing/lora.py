"""LoRA in the traced step: the same adapters memplan/model/lora.py puts in the inventory, added to the module
the trace runs, with PEFT's forward (peft 0.22, peft/tuners/lora/layer.py Linear.forward):

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

from typing import Any

from memplan.inputs import REGEX_SECONDS, deadline
from memplan.model.lora import LoraSpec, matching, output_module_name, patterns, resolve


def _layer_kind(m: Any) -> str:
    from memplan.model.meta_builder import _layer_kind as kind

    return kind(m)


def _module_class() -> Any:
    import torch
    from torch import nn

    class LoraLinear(nn.Module):
        """peft.tuners.lora.Linear's forward for one adapter (named "default", as PEFT names it)."""

        def __init__(self, base: nn.Module, r: int, dropout: float, scaling: float, conv1d: bool,
                     dtype: Any = None) -> None:
            super().__init__()
            self.base_layer = base
            w = base.weight
            fan_in, fan_out = (w.shape[0], w.shape[1]) if conv1d else (w.shape[1], w.shape[0])
            self.lora_dropout = nn.Dropout(p=dropout) if dropout > 0 else nn.Identity()
            self.lora_A = nn.Linear(fan_in, r, bias=False, dtype=dtype or w.dtype)
            self.lora_B = nn.Linear(r, fan_out, bias=False, dtype=dtype or w.dtype)
            self.scaling = scaling

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            result = self.base_layer(x, *args, **kwargs)
            torch_result_dtype = result.dtype
            if x.dtype != self.lora_A.weight.dtype:
                x = x.to(dtype=self.lora_A.weight.dtype)
            result = result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
            return result.to(torch_result_dtype)

    return LoraLinear


_QUANT_CLASSES: dict[str, Any] = {}


def _quant_classes() -> tuple[Any, Any]:
    """bitsandbytes 0.50's Linear4bit (nn/modules.py) and PEFT's LoRA layer over it (peft/tuners/lora/bnb.py
    Linear4bit), as stand-ins the fake tensors can run: the same tensors are allocated and saved, no 4-bit
    arithmetic is done."""
    if _QUANT_CLASSES:
        return _QUANT_CLASSES["base"], _QUANT_CLASSES["lora"]
    import torch
    from torch import nn

    class MatMul4Bit(torch.autograd.Function):
        """autograd/_functions.py MatMul4Bit with gemm_4bit's dequantize-then-F.linear path (backends/cuda/ops.py
        _dequant_linear_fallback; the CPU's default _gemm_4bit_default_impl): the absmax dequantized to fp32
        when doubly quantized (plus the offset: a second [blocks] fp32 tensor; the CUDA path keeps both to its
        end), the weight dequantized into the input's dtype for the GEMM. ctx keeps only the packed weight (a
        parameter): nothing of the input is saved. Backward dequantizes again, into the quantized weight's
        dtype (QuantState.dtype), casts to the gradient's dtype and multiplies."""

        @staticmethod
        def forward(ctx: Any, a: Any, packed: Any, bias: Any, layer: Any) -> Any:
            absmax = None
            if layer.double_quant:
                absmax_dq = torch.empty(layer.blocks, dtype=torch.float32)
                absmax = absmax_dq + 0.0
                if not layer.cuda_path:
                    del absmax_dq
            w = torch.empty((layer.out_features, layer.in_features), dtype=a.dtype)
            out = torch.nn.functional.linear(a, w, bias)
            del w, absmax
            ctx.layer = layer
            ctx.bias_dtype = None if bias is None else bias.dtype
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            layer = ctx.layer
            grad_a = grad_bias = None
            if ctx.needs_input_grad[2]:
                grad_bias = grad.sum(0, dtype=ctx.bias_dtype)
            if ctx.needs_input_grad[0]:
                # functional.py dequantize_4bit: the absmax dequantized (fp32) and freed on its return
                held = [torch.empty(layer.blocks, dtype=torch.float32)] if layer.double_quant else []
                w = torch.empty((layer.out_features, layer.in_features), dtype=layer.quant_dtype)
                held.clear()
                w = w.to(grad.dtype)  # the dequantized copy freed once cast (a temporary in bitsandbytes)
                grad_a = torch.matmul(grad, w)
            return grad_a, None, grad_bias, None

    class Linear4bit(nn.Linear):
        """nn/modules.py Linear4bit.forward: the input cast to the compute dtype (BitsAndBytesConfig's
        bnb_4bit_compute_dtype, which transformers always passes: set_compute_type never runs), the bias too, the
        output cast back to the input's dtype."""

        def __init__(self, base: nn.Module, double_quant: bool, cuda_path: bool, conv1d: bool,
                     compute_dtype: Any) -> None:
            nn.Module.__init__(self)
            w = base.weight
            self.out_features, self.in_features = (w.shape[1], w.shape[0]) if conv1d else (w.shape[0], w.shape[1])
            n = self.out_features * self.in_features
            self.weight = nn.Parameter(torch.empty(((n + 1) // 2, 1), dtype=torch.uint8), requires_grad=False)
            # forward casts the bias to the compute dtype in place on its first call; from then on it is that
            self.bias = None if base.bias is None else nn.Parameter(base.bias.detach().to(compute_dtype),
                                                                    requires_grad=base.bias.requires_grad)
            self.blocks = -(-n // 64)
            self.double_quant, self.cuda_path = double_quant, cuda_path
            # quantized from a bf16 load (transformers 5 loads in the config's dtype, dtype="auto")
            self.quant_dtype = torch.bfloat16
            self.compute_dtype = compute_dtype

        def forward(self, x: Any) -> Any:
            inp_dtype = x.dtype
            x = x.to(self.compute_dtype)
            bias = self.bias
            if bias is not None:
                bias = bias.to(self.compute_dtype)
            return MatMul4Bit.apply(x, self.weight, bias, self).to(inp_dtype)

    class LoraLinear4bit(nn.Module):
        """peft/tuners/lora/bnb.py Linear4bit.forward: the base's result cloned ("defensively", as PEFT says),
        the adapters in their own dtype (fp32: PEFT keeps them as created next to a uint8 weight; 16-bit where the
        framework casts them, the trace config's adapter_dtype) unless
        autocast is on (torch.is_autocast_enabled(), CUDA's: off on the CPU harness), their output cast to the
        result's dtype and added."""

        def __init__(self, base: nn.Module, r: int, dropout: float, scaling: float, conv1d: bool,
                     dtype: Any = None) -> None:
            super().__init__()
            self.base_layer = base
            self.lora_dropout = nn.Dropout(p=dropout) if dropout > 0 else nn.Identity()
            dtype = dtype or torch.float32  # fp32 unless the framework computes them in 16 bits (options.py)
            self.lora_A = nn.Linear(base.in_features, r, bias=False, dtype=dtype)
            self.lora_B = nn.Linear(r, base.out_features, bias=False, dtype=dtype)
            self.scaling = scaling

        def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
            result = self.base_layer(x, *args, **kwargs).clone()
            conversion = not (self.base_layer.cuda_path and torch.is_autocast_enabled("cpu"))
            if conversion:
                expected = result.dtype
                if x.dtype != self.lora_A.weight.dtype:
                    x = x.to(self.lora_A.weight.dtype)
            output = self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
            if conversion:
                output = output.to(expected)
            return result + output

    _QUANT_CLASSES.update(base=Linear4bit, lora=LoraLinear4bit)
    return Linear4bit, LoraLinear4bit


def quantize(model: Any, fields: dict[str, Any], cuda: bool) -> int:
    """bitsandbytes' 4-bit base in place, as transformers quantizes at load (integrations/bitsandbytes.py
    replace_with_bnb_linear: every ``type(m) is nn.Linear`` and Conv1D but quantizers/base.py
    get_keys_to_not_convert's: tied weights, the last parameter's module, the output embedding, and the class's
    _keep_in_fp32_modules); the number of layers replaced."""
    import torch
    from torch import nn

    from memplan.model.lora import kept_in_fp32

    cls, _ = _quant_classes()
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    unique = list(model.named_parameters())
    last = unique[-1][0].rpartition(".")[0] if unique else None
    named = list(model.named_parameters(remove_duplicate=False))
    seen: dict[int, int] = {}
    for _, p in named:
        seen[id(p)] = seen.get(id(p), 0) + 1
    tied = {n.rpartition(".")[0] for n, p in named if seen[id(p)] > 1}
    modules = dict(model.named_modules())
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())  # T5's "wo": not converted (model/lora.py)
    count = 0
    for name, m in list(modules.items()):
        kind = _layer_kind(m)
        if not name or m is out_emb or name in tied or name == last or kept_in_fp32(name, keep):
            continue
        if type(m) is not nn.Linear and kind != "conv1d":
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, leaf, cls(m, bool(fields.get("double_quant")), cuda, kind == "conv1d",
                                  getattr(torch, fields.get("compute_dtype", "bfloat16"))))
        count += 1
    return count


def param_wrapper_class() -> Any:
    """peft/tuners/lora/layer.py ParamWrapper (LoRA on one nn.Parameter) for one adapter, as it runs: lora_A
    [r * experts, in] and lora_B [out, r * experts] (in the parameter's dtype unless the framework casts them:
    adapter_dtype); each forward registers a parametrization on the wrapped module (torch.nn.utils.parametrize,
    unsafe=False: registering evaluates it once to check its shape and dtype), runs the module under
    parametrize.cached() (the folded weight is computed at its first read and kept until the outermost cached()
    exits) and removes it. For an expert stack with one adapter (_LoraFactorsProxy) the fold is one baddbmm(W,
    lhs, rhs) in W's dtype with autocast off, lhs/rhs the adapters' views cast to W's dtype; for a 2-D weight
    (_LoraParameterProxy) W + (B @ A) * scaling cast to W's dtype (lora.Linear.get_delta_weight as it runs on
    CUDA: no fp32 round trip)."""
    import torch
    from torch import nn
    from torch.nn.utils import parametrize

    class FactorsProxy(nn.Module):
        def __init__(self, lhs: Any, rhs: Any, scaling: float) -> None:
            super().__init__()
            self.lhs, self.rhs, self.scaling = lhs, rhs, scaling

        def forward(self, w: Any) -> Any:
            with torch.autocast(device_type=w.device.type, enabled=False):
                return torch.baddbmm(w, self.lhs, self.rhs, alpha=self.scaling)

    class DeltaProxy(nn.Module):
        def __init__(self, delta: Any) -> None:
            super().__init__()
            self.delta = delta

        def forward(self, w: Any) -> Any:
            return w + self.delta

    class ParamWrapper(nn.Module):
        def __init__(self, base: nn.Module, parameter_name: str, r: int, scaling: float, dtype: Any) -> None:
            super().__init__()
            self.base_layer = base
            self.parameter_name = parameter_name
            param = self.get_param()
            shape = param.shape
            if len(shape) == 3:
                experts, fan_in, fan_out = shape
                self.swapped = not getattr(self.get_base_layer(), "is_transposed", False)
                if self.swapped:
                    fan_in, fan_out = fan_out, fan_in
            else:
                (fan_out, fan_in), experts, self.swapped = shape, 1, False
            self.experts = experts
            self.lora_A = nn.Linear(fan_in, r * experts, bias=False, dtype=dtype or param.dtype)
            self.lora_B = nn.Linear(r * experts, fan_out, bias=False, dtype=dtype or param.dtype)
            self.scaling = scaling

        def get_base_layer(self) -> nn.Module:
            m = self.base_layer
            while isinstance(m, ParamWrapper):
                m = m.base_layer
            return m

        def get_param(self) -> Any:
            return getattr(self.get_base_layer(), self.parameter_name)

        def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
            param = self.get_param()
            a, b = self.lora_A.weight, self.lora_B.weight
            if self.experts > 1:
                a = a.reshape(self.experts, -1, a.shape[-1])
                b = b.reshape(b.shape[0], -1, self.experts).permute(2, 0, 1)
                lhs, rhs = (b, a) if self.swapped else (a.transpose(-2, -1), b.transpose(-2, -1))
                proxy: nn.Module = FactorsProxy(lhs.to(param.dtype), rhs.to(param.dtype), self.scaling)
            else:
                proxy = DeltaProxy(((b @ a) * self.scaling).to(param.device, param.dtype))
            base = self.get_base_layer()
            before = param.requires_grad
            parametrize.register_parametrization(base, self.parameter_name, proxy)
            base.parametrizations[self.parameter_name].original.requires_grad_(before)
            try:
                with parametrize.cached():
                    return self.base_layer(x, *args, **kwargs)
            finally:
                parametrize.remove_parametrizations(base, self.parameter_name, leave_parametrized=False)

    return ParamWrapper


def inject(model: Any, fields: dict[str, Any], family: str) -> int:
    """Add the adapters to ``model`` in place and freeze what PEFT freezes; the number of adapted layers."""
    spec = LoraSpec.from_trace_fields(fields)
    owned = [(name, m) for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    owners = [(name, _layer_kind(m)) for name, m in owned]
    params = [(f"{name}.{leaf}" if name else leaf, name) for name, m in owned
              for leaf, _ in m.named_parameters(recurse=False)]
    out_name = output_module_name(model)
    with deadline(REGEX_SECONDS, matching(spec)):
        found = resolve(spec, family, owners, params, out_name)
        pats = patterns(found.spec)
        saved = {name for name, _ in model.named_modules() if pats.saved(name)}
    chosen, ranks = found.modules, found.ranks
    for p in model.parameters():
        p.requires_grad_(False)
    for name, m in model.named_modules():  # biases PEFT leaves trainable, and modules_to_save (trained whole)
        if name in saved:
            for p in m.parameters():
                p.requires_grad_(True)
        bias = getattr(m, "bias", None)
        if bias is not None and hasattr(bias, "requires_grad_") and (
                spec.bias == "all" or (spec.bias == "lora_only" and name in chosen)):
            bias.requires_grad_(True)
    cls = _module_class()
    import torch

    adapter_dtype = getattr(torch, fields["adapter_dtype"]) if fields.get("adapter_dtype") else None
    modules = dict(model.named_modules())
    for name in chosen:
        parent_name, _, leaf = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        base = modules[name]
        r = ranks[name]
        four_bit = _QUANT_CLASSES and isinstance(base, _QUANT_CLASSES["base"])
        conv1d = _layer_kind(base) == "conv1d"
        if four_bit:
            setattr(parent, leaf, _QUANT_CLASSES["lora"](base, r, spec.dropout, 1.0, conv1d, adapter_dtype))
        else:  # PEFT's fp32 adapters on a bf16 base (get_peft_model's autocast_adapter_dtype)
            setattr(parent, leaf, cls(base, r, spec.dropout, 1.0, conv1d, adapter_dtype))
    wrapper = param_wrapper_class()
    owner = dict(params)
    for pname in found.params:  # each wraps what the module's name holds now: the first is innermost
        name = owner[pname]
        parent_name, _, leaf = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, leaf, wrapper(getattr(parent, leaf), pname.rpartition(".")[2], ranks[pname], 1.0,
                                      adapter_dtype))
    return len(chosen) + len(found.params)
