"""LoRA adapters as PEFT adds them (peft 0.22, peft/tuners/lora): which modules get adapters, the tensors each
adds and which parameters stay frozen. Pure Python on the ParamInventory (no torch), so the preset path stays
fast; the traced step injects the same adapters (memplan/activations/tracing/lora.py) and the harness runs PEFT itself.

What PEFT does, and therefore what this module models:
- target matching (peft/tuners/tuners_utils.py check_target_module_exists): a string is a regular expression
  that must match a module's whole name (re.fullmatch); a list matches a module whose name equals an entry or
  ends with "." + entry; "all-linear" is every nn.Linear and transformers Conv1D but the output embedding
  (_maybe_include_all_linear_layers); modules in modules_to_save are never targeted; layers_to_transform keeps
  the matches inside the listed layer indices. No match is an error ("Target modules ... not found").
- a targeted layer keeps its weight as ``<module>.base_layer.weight`` and gains ``lora_A.default.weight``
  [r, in_features] and ``lora_B.default.weight`` [out_features, r], registered after the base layer
  (peft/tuners/lora/layer.py LoraLayer.update_layer; Conv1D's in/out come from its [in, out] weight);
- every base parameter is frozen (_mark_only_adapters_as_trainable), except biases with bias="all" (every
  bias) or "lora_only" (the targeted layers'); modules_to_save keep the original frozen and add a trainable
  copy (ModulesToSaveWrapper: ``<module>.modules_to_save.default.*``);
- rank_pattern / alpha_pattern give some modules another rank (the same key matching as PEFT's get_pattern_key).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError, SettingsError
from memplan.inputs import REGEX_SECONDS, compile_pattern, deadline, quote
from memplan.model.inventory import HEAD_PREFIXES, ROOT_BLOCK, ParamInventory, ParamTensor
from memplan.units import dtype_bytes

ALL_LINEAR = "all-linear"
QUANT_TYPES = ("", "nf4", "fp4")
#: BitsAndBytesConfig.bnb_4bit_quant_storage: the dtype bitsandbytes packs the 4-bit codes into (quantize_4bit:
#: out = empty(((n + 1) // (quant_storage.itemsize * 2), 1), dtype=quant_storage); bitsandbytes 0.50 _ops.py)
QUANT_STORAGES = ("uint8", "bfloat16", "float16", "float32")
#: the largest LoRA rank memplan sizes: past every real layer's width (a rank above min(in, out) adds nothing PEFT
#: would not refuse to make useful, and a rank of 10^300 would take the inventory's arithmetic hours)
MAX_RANK = 1 << 20
#: bitsandbytes' 4-bit block size (functional.py quantize_4bit: blocksize None -> 64; transformers'
#: BitsAndBytesConfig passes none) and the block size of double quantization's second level (256)
QUANT_BLOCK = 64
QUANT_BLOCK2 = 256

#: peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: PEFT's targets when the adapter
#: config names none (the families memplan builds)
DEFAULT_TARGETS: dict[str, tuple[str, ...] | str] = {
    # PEFT 0.22.0's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (peft/utils/constants.py), whole
    "t5": ("q", "v"), "mt5": ("q", "v"), "bart": ("q_proj", "v_proj"), "gpt2": ("c_attn",),
    "bloom": ("query_key_value",), "blip-2": ("q", "v", "q_proj", "v_proj"), "opt": ("q_proj", "v_proj"),
    "gptj": ("q_proj", "v_proj"), "gpt_neox": ("query_key_value",), "gpt_neo": ("q_proj", "v_proj"),
    "bert": ("query", "value"), "roberta": ("query", "value"), "xlm-roberta": ("query", "value"),
    "electra": ("query", "value"), "deberta-v2": ("query_proj", "value_proj"), "deberta": ("in_proj",),
    "layoutlm": ("query", "value"), "llama": ("q_proj", "v_proj"), "llama4": ("q_proj", "v_proj"),
    "chatglm": ("query_key_value",), "gpt_bigcode": ("c_attn",), "mpt": ("Wqkv",),
    "RefinedWebModel": ("query_key_value",), "RefinedWeb": ("query_key_value",), "falcon": ("query_key_value",),
    "btlm": ("c_proj", "c_attn"), "codegen": ("qkv_proj",), "mistral": ("q_proj", "v_proj"),
    "mixtral": ("q_proj", "v_proj"), "stablelm": ("q_proj", "v_proj"), "phi": ("q_proj", "v_proj", "fc1", "fc2"),
    "gemma": ("q_proj", "v_proj"), "gemma2": ("q_proj", "v_proj"), "gemma3_text": ("q_proj", "v_proj"),
    "gemma4": r".*language_model\..*\.(q_proj|v_proj)", "qwen2": ("q_proj", "v_proj"), "qwen3": ("q_proj", "v_proj"),
    "nemotron_h": ("q_proj", "k_proj", "v_proj", "o_proj"), "rwkv": ("key", "value", "receptance", "output"),
    "rwkv7": ("r_proj", "k_proj", "v_proj", "o_proj", "key", "value"),
}

#: adapter_config.json keys that change what memplan computes, and those that do not change memory
_READ = {"r", "lora_alpha", "lora_dropout", "target_modules", "bias", "modules_to_save", "layers_to_transform",
         "rank_pattern", "alpha_pattern", "peft_type", "exclude_modules", "target_parameters"}
_NO_MEMORY = {"base_model_name_or_path", "task_type", "inference_mode", "use_rslora", "init_lora_weights",
              "fan_in_fan_out", "revision", "auto_mapping", "layers_pattern", "megatron_config", "megatron_core",
              "loftq_config", "layer_replication", "lora_bias", "trainable_token_indices",
              "eva_config", "corda_config", "runtime_config", "qalora_group_size", "peft_version",
              "alora_invocation_tokens", "use_qalora", "arrow_config", "ensure_weight_tying", "lora_ga_config",
              "use_bdlora", "bdlora_config"}


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA adapter as PEFT's LoraConfig describes it."""

    rank: int = 8
    alpha: float = 8
    #: module names (PEFT's list matching), one regular expression (str), or "all-linear"; () -> PEFT's default
    #: for the model type
    targets: tuple[str, ...] | str = ()
    dropout: float = 0.0
    bias: str = "none"  #: none | all | lora_only
    modules_to_save: tuple[str, ...] = ()
    layers_to_transform: tuple[int, ...] = ()
    exclude_modules: tuple[str, ...] = ()
    rank_pattern: tuple[tuple[str, int], ...] = ()
    #: PEFT's target_parameters: nn.Parameter names (or their ends) lora.ParamWrapper adapts (resolve_parameters)
    target_parameters: tuple[str, ...] = ()
    #: the spec as PEFT's transformers-5 conversion left it (convert_targets): no default targets are filled in
    converted: bool = False
    #: where it came from ("--lora-rank", or the adapter_config.json path)
    source: str = "--lora-rank"
    #: QLoRA: the base's linear weights stored 4-bit by bitsandbytes ("nf4" or "fp4"; "" keeps them as the recipe
    #: stores parameters), with BitsAndBytesConfig's bnb_4bit_use_double_quant; see quantize_base
    quantize: str = ""
    double_quant: bool = False
    #: BitsAndBytesConfig.bnb_4bit_compute_dtype: what each 4-bit layer casts its input to and dequantizes into
    #: (transformers always passes one, so Linear4bit.set_compute_type never picks the input's)
    compute_dtype: str = "bfloat16"
    #: BitsAndBytesConfig.bnb_4bit_quant_storage: "uint8" (its default) packs two codes per byte into a uint8
    #: tensor no FSDP or ZeRO-3 shards; a float dtype packs them into that dtype, a frozen parameter FSDP and
    #: ZeRO-3 shard like the others (FSDP-QLoRA: PEFT's, Accelerate's and Answer.AI's recipes)
    quant_storage: str = "uint8"
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise SettingsError(f"--lora-rank must be at least 1, got {self.rank}")
        own = "--lora-rank" if self.source == "--lora-rank" else "r"
        for where, r in ((own, self.rank), *((f"rank_pattern {quote(k)}", v) for k, v in self.rank_pattern)):
            if r > MAX_RANK:
                raise SettingsError(f"{where} {quote(r)} is more than any LoRA rank memplan sizes ({MAX_RANK:,}: "
                                    "past every layer's width)")
        if self.bias not in ("none", "all", "lora_only"):
            raise SettingsError(f"LoRA bias must be none, all or lora_only, got {quote(self.bias)}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise SettingsError(f"--lora-alpha must be a positive number, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise SettingsError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if self.quantize == "int8":
            raise SettingsError("--quantize-base int8 (bitsandbytes LLM.int8, Linear8bitLt) is not modelled; "
                                "nf4 or fp4 (Linear4bit) are")
        if self.quantize not in QUANT_TYPES:
            raise SettingsError(f"--quantize-base must be nf4 or fp4, got {quote(self.quantize)}")
        if self.compute_dtype not in ("bfloat16", "float16", "float32"):
            raise SettingsError(f"--quant-compute-dtype must be bfloat16, float16 or float32, got "
                                f"{quote(self.compute_dtype)}")
        if self.double_quant and not self.quantize:
            raise SettingsError("--double-quant quantizes a 4-bit base's scales: give --quantize-base nf4|fp4")
        if self.quant_storage not in QUANT_STORAGES:
            raise SettingsError(f"--quant-storage must be one of {', '.join(QUANT_STORAGES)}, got "
                                f"{quote(self.quant_storage)}")
        if self.quant_storage != "uint8" and not self.quantize:
            raise SettingsError("--quant-storage is the dtype a 4-bit base is packed into: give --quantize-base "
                                "nf4|fp4")

    def trace_fields(self) -> dict[str, Any]:
        """What the traced step needs (and its cache key holds): the adapted modules are resolved by the trace
        from the same spec."""
        quant = {"quantize": self.quantize, "double_quant": self.double_quant,
                 "compute_dtype": self.compute_dtype} if self.quantize else {}
        return {**quant, "r": self.rank,
                "targets": list(self.targets) if isinstance(self.targets, tuple) else self.targets,
                "dropout": self.dropout, "bias": self.bias, "modules_to_save": list(self.modules_to_save),
                "layers_to_transform": list(self.layers_to_transform), "exclude": list(self.exclude_modules),
                "rank_pattern": [list(p) for p in self.rank_pattern],
                **({"target_parameters": list(self.target_parameters)} if self.target_parameters else {})}

    @classmethod
    def from_trace_fields(cls, d: dict[str, Any]) -> LoraSpec:
        t = d.get("targets")
        return cls(rank=d["r"], targets=t if isinstance(t, str) else tuple(t or ()), dropout=d.get("dropout", 0.0),
                   bias=d.get("bias", "none"), modules_to_save=tuple(d.get("modules_to_save") or ()),
                   layers_to_transform=tuple(d.get("layers_to_transform") or ()),
                   exclude_modules=tuple(d.get("exclude") or ()),
                   rank_pattern=tuple((k, int(v)) for k, v in d.get("rank_pattern") or ()),
                   target_parameters=tuple(d.get("target_parameters") or ()),
                   quantize=d.get("quantize", ""), double_quant=bool(d.get("double_quant", False)),
                   compute_dtype=d.get("compute_dtype", "bfloat16"))

    def describe(self) -> str:
        t = self.targets if isinstance(self.targets, str) else ",".join(self.targets) or (
            "" if self.target_parameters else "PEFT's default")
        if self.target_parameters:
            t = ",".join(filter(None, (t, *self.target_parameters)))
        return ("QLoRA" if self.quantize else "LoRA") + f" r={self.rank} on {t}" + \
            (f", bias={self.bias}" if self.bias != "none" else "") + \
            (f", modules_to_save={','.join(self.modules_to_save)}" if self.modules_to_save else "") + \
            (f", base in {self.quantize}" + (" with double quantization" if self.double_quant else "") +
             (f", packed into {self.quant_storage}" if self.quant_storage != "uint8" else "")
             if self.quantize else "")


def _ends(key: str, names: tuple[str, ...]) -> bool:
    return key in names or any(key.endswith("." + n) for n in names)


def _layer_index(key: str) -> int | None:
    m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)  # PEFT: the first numbered segment
    return int(m.group("idx")) if m else None


#: The model types whose LoRA targets PEFT 0.22.0 remaps onto transformers 5's fused MoE parameters
#: (peft/utils/transformers_weight_conversion.py convert_peft_config_for_transformers, called first thing in
#: tuners_utils.py inject_adapter): transformers 5.24's conversion_mapping._MODEL_TO_CONVERSION_PATTERN entries
#: whose pattern PEFT has a _MOE_TARGET_MODULE_MAPPING for, plus "mixtral" and "qwen2_moe" themselves (PEFT 0.22
#: adds both). A copy (the fast path imports neither), held equal to the installed versions' by
#: tests/adapters/test_lora.py.
MOE_CONVERSION: dict[str, str] = {
    "mixtral": "mixtral", "minimax": "mixtral", "minimax_m2": "mixtral",
    **{t: "qwen2_moe" for t in (
        "Dots3NoteTextModel", "afmoe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "ernie4_5_moe",
        "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "glm4v_moe", "longcat_flash", "solar_open", "mellum",
        "qwen3_moe", "beam", "qwen3_omni_moe", "qwen3_omni_moe_thinker", "qwen3_omni_moe_text", "qwen3_next",
        "hunyuan_v1_moe", "flex_olmo", "olmoe", "sarvam_mla", "exaone_moe", "cohere2_moe",
        "UnlimitedOcrTextModel", "qwen2_moe")}}
#: PEFT's _MOE_TARGET_MODULE_MAPPING (in its order: the first old name a target ends with wins): a v4 module name and
#: the v5 parameter PEFT targets instead (target_parameters), and its _MOE_FUSED_TARGETS: the v4 names fused into one
#: parameter, all of which must be targeted; PEFT then doubles that parameter's rank and alpha (rank_pattern)
MOE_TARGET_MODULE_MAPPING: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": (("gate", "gate.weight"), ("w1", "gate_up_proj"), ("w3", "gate_up_proj"), ("w2", "down_proj")),
    "qwen2_moe": (("gate", "gate.weight"), ("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj"),
                  ("down_proj", "down_proj")),
}
MOE_FUSED_TARGETS: dict[str, dict[str, tuple[str, ...]]] = {
    "mixtral": {"gate_up_proj": ("w1", "w3")}, "qwen2_moe": {"gate_up_proj": ("gate_proj", "up_proj")}}


@dataclass(frozen=True)
class Resolved:
    """What PEFT adapts in one model: the spec as PEFT leaves it after its transformers-5 conversion, the modules
    lora.Linear wraps (in module order) and the parameters lora.ParamWrapper wraps (in module order, each module's
    own in registration order: the first is the innermost wrapper), with each one's rank."""

    spec: LoraSpec
    modules: tuple[str, ...]
    params: tuple[str, ...]
    ranks: dict[str, int]


def resolve(spec: LoraSpec, family: str, modules: list[tuple[str, str]], params: list[tuple[str, str]],
            output_module: str | None) -> Resolved:
    """The modules and parameters PEFT adapts, from (module name, layer kind) pairs of the modules that own
    parameters and (parameter name, owning module) pairs, both in module order. Run under the caller's deadline
    (the user's patterns)."""
    spec = convert_targets(spec, family, modules, [p for p, _ in params], output_module)
    chosen = resolve_targets(spec, modules, family, output_module)
    wrapped = resolve_parameters(spec, params, set(chosen))
    if not chosen and not wrapped:
        shown = spec.targets or spec.target_parameters
        shown_text = quote(shown, 80) if isinstance(shown, str) else quote(", ".join(shown), 80).strip("'")
        raise SettingsError(f"LoRA targets {shown_text} match no linear layer or parameter of this model (PEFT: "
                            "'Target modules ... not found in the base model')")
    pats = patterns(spec)
    return Resolved(spec, tuple(chosen), tuple(wrapped), {n: pats.rank_for(n) for n in (*chosen, *wrapped)})


def convert_targets(spec: LoraSpec, family: str, modules: list[tuple[str, str]], params: list[str],
                    output_module: str | None) -> LoraSpec:
    """The spec as peft 0.22.0's _convert_peft_config_moe rewrites it for a model type transformers 5 converts
    (MOE_CONVERSION): a string target is first resolved to the leaf names it reaches (all-linear: every linear
    layer's leaf name plus every v4 expert and router name; a pattern: the leaf names of the module and parameter
    names it fully matches, and a v4 expert name where it matches that name under a fused parameter's module), so
    a pattern becomes a list of leaf names that matches those leaves in every layer; then each target naming a v4
    expert or router module (itself or as its last name) becomes a target_parameters entry (its v5 name put in
    place of the v4 one, from the right) and leaves target_modules, unless every module it reaches is an nn.Linear:
    then it stays a module target, and is a parameter target too only where a non-Linear module has a parameter of
    the v5 name (peft#3711, #3945: DeepSeek-V3's dense and shared-expert down_proj keep their adapters beside the
    routed experts'). Fused pairs get twice the rank. With no targets given, PEFT has none: its default (applied
    after this) never comes."""
    base = MOE_CONVERSION.get(family)
    if base is None:
        return spec
    mapping = MOE_TARGET_MODULE_MAPPING[base]
    targets = spec.targets
    if isinstance(targets, str):
        if targets == ALL_LINEAR:
            resolved = {n.rpartition(".")[2] for n, kind in modules
                        if kind in ("linear", "conv1d") and n != output_module} | {old for old, _ in mapping}
        else:
            pats = patterns(spec)
            rx = pats.target(targets)
            keys = {p.rpartition(".")[0] for p in params} | set(params)
            keys |= {k.rsplit(".", i)[0] for k in list(keys) for i in range(1, k.count(".") + 1)}
            resolved = {k.rpartition(".")[2] for k in keys if rx.fullmatch(k)}
            containers: dict[str, list[str]] = {}
            for name in params:
                container, _, leaf = name.rpartition(".")
                containers.setdefault(leaf, []).append(container)
            for old, new in mapping:
                if old not in resolved and any(rx.fullmatch(f"{c}.{old}") for c in containers.get(new, ())):
                    resolved.add(old)
        if not resolved:
            return spec  # nothing matched: PEFT leaves the pattern, and its own not-found error follows
        targets = tuple(sorted(resolved))
    new_params = set(spec.target_parameters)
    remaining: set[str] = set()
    matched: dict[str, set[str]] = {}
    kinds = dict(modules)
    # parameters only target_parameters can reach: those of modules that are not nn.Linear (the fused experts)
    non_linear = [p for p in params if kinds.get(p.rpartition(".")[0]) != "linear"]
    pats = patterns(spec)

    def reaches(name: str, t: str) -> bool:
        """check_target_module_exists with target_modules {t}: excluded and saved modules never, the layers given"""
        if not (name == t or name.endswith("." + t)) or pats.saved(name):
            return False
        if spec.exclude_modules and _ends(name, spec.exclude_modules):
            return False
        return not spec.layers_to_transform or _layer_index(name) in spec.layers_to_transform
    for t in targets:
        hit = next(((old, new) for old, new in mapping if t == old or t.endswith("." + old)), None)
        if hit is None:
            remaining.add(t)
            continue
        old, new = hit
        name = new.join(t.rsplit(old, 1))  # str_rreplace: gate -> gate.weight, layers.0.gate -> layers.0.gate.weight
        # a name that is an nn.Linear module wherever it matches stays a module target (DeepSeek-V3's dense and
        # shared-expert down_proj), and becomes a parameter target as well only where a non-Linear module's
        # parameter has the new name (the routed experts' down_proj beside them)
        reach = [n for n, _ in modules if reaches(n, t)]
        if reach and all(kinds[n] == "linear" for n in reach):
            remaining.add(t)
            if not any(p == name or p.endswith("." + name) for p in non_linear):
                continue
        new_params.add(name)
        matched.setdefault(new, set()).add(old)
    extra: list[tuple[str, int]] = []
    for new, olds in MOE_FUSED_TARGETS[base].items():
        present = matched.get(new, set())
        if 0 < len(present) < len(olds):
            raise SettingsError(f"PEFT cannot adapt {', '.join(sorted(present))} without also "
                                f"{', '.join(sorted(set(olds) - present))}: transformers 5 fuses them into {new} "
                                "(peft's _convert_peft_config_moe raises)")
        if len(present) == len(olds) > 1:
            extra.append((rf".*\.{re.escape(new)}", spec.rank * len(olds)))
    if not remaining and not new_params:
        raise SettingsError(f"PEFT has no default LoRA targets for {family} under transformers 5 (its conversion "
                            "empties target_modules before the default is filled in: 'No `target_modules` passed but "
                            "also no `target_parameters` found'): give --lora-targets")
    return replace(spec, targets=tuple(sorted(remaining)), target_parameters=tuple(sorted(new_params)),
                   rank_pattern=spec.rank_pattern + tuple(extra), converted=True)


def resolve_parameters(spec: LoraSpec, params: list[tuple[str, str]], modules: set[str]) -> list[str]:
    """The parameters lora.ParamWrapper wraps (peft/tuners/tuners_utils.py _inject_parameters): each module's own
    parameters whose name is a target_parameters entry or ends with "." + one; layers_to_transform and
    exclude_modules do not apply to them. PEFT refuses a parameter of the root, of a module target_modules
    already wraps, and any dropout (ParamWrapper cannot factor it out)."""
    names = spec.target_parameters
    if not names:
        return []
    out = [p for p, _ in params if p in names or any(p.endswith("." + n) for n in names)]
    owners = dict(params)
    for p in out:
        if owners[p] in modules:
            raise SettingsError(f"LoRA target_parameters {quote(p)} is a parameter of {owners[p]}, which target_modules "
                                "also adapts (PEFT: 'not a valid target'); leave one of them out")
        if not owners[p]:
            raise SettingsError(f"LoRA target_parameters {quote(p)} is a parameter of the model's root: PEFT cannot "
                                "wrap it")
    if out and spec.dropout:
        raise SettingsError(f"LoRA on parameters ({', '.join(spec.target_parameters)}: lora.ParamWrapper) does not "
                            "work with lora_dropout != 0 (PEFT refuses it): set the dropout to 0")
    return out


def resolve_targets(spec: LoraSpec, modules: list[tuple[str, str]], family: str, output_module: str | None
                    ) -> list[str]:
    """The modules PEFT adds adapters to, in module order, from (module name, layer kind) pairs."""
    # PEFT's default (lora/model.py _prepare_adapter_config) comes only where target_modules is None: never after
    # its conversion ran (an empty set by then), and none is needed where target_parameters are given
    targets = spec.targets if spec.converted else spec.targets or DEFAULT_TARGETS.get(family, ())
    if not targets and (spec.converted or spec.target_parameters):
        return []
    if not targets:
        raise SettingsError(f"PEFT has no default LoRA targets for model type {quote(family)}: give --lora-targets")
    pats = patterns(spec)
    out = []
    for name, kind in modules:
        if spec.exclude_modules and _ends(name, spec.exclude_modules):
            continue
        if pats.saved(name):
            continue
        if targets == ALL_LINEAR:
            hit = kind in ("linear", "conv1d") and name != output_module
        elif isinstance(targets, str):
            hit = pats.target(targets).fullmatch(name) is not None
        else:
            hit = _ends(name, targets)
            if hit and spec.layers_to_transform:
                hit = _layer_index(name) in spec.layers_to_transform
        if not hit:
            continue
        if kind not in ("linear", "conv1d"):
            what = {"embedding": "an embedding", "": "not a Linear or Conv1D layer"}.get(kind, kind)
            raise SettingsError(f"LoRA target {name} is {what}: memplan models LoRA on linear layers "
                                "(PEFT's lora.Linear); put it in modules_to_save to train it whole")
        out.append(name)
    if not out and not spec.target_parameters:
        shown = quote(targets, 80) if isinstance(targets, str) else quote(", ".join(targets), 80).strip("'")
        raise SettingsError(f"LoRA target modules {shown} match no linear layer of this model (PEFT: 'Target "
                            "modules not found in the base model')")
    return out


class Patterns:
    """The user's regular expressions of one LoRA spec, compiled once (an invalid one is a one-line error naming
    it): target_modules as one pattern (re.fullmatch, peft/tuners/tuners_utils.py check_target_module_exists),
    modules_to_save entries (a module whose name is the entry or ends with "." + entry, as a pattern:
    ModulesToSaveWrapper's match) and rank_pattern keys (peft/utils/other.py get_pattern_key: the key's own end, or
    a regex). Matching runs under inputs.deadline (callers wrap their loops): Python's engine backtracks."""

    def __init__(self, spec: LoraSpec) -> None:
        self._targets: dict[str, Any] = {}
        self.save = [compile_pattern(rf"(^|.*\.){m}($|\..*)", f"LoRA modules_to_save entry {quote(m)}:")
                     for m in spec.modules_to_save]
        self.ranks = [(key, compile_pattern(rf"(.*\.)?{key}", f"LoRA rank_pattern key {quote(key)}:"), r)
                      for key, r in spec.rank_pattern]
        self.default_rank = spec.rank

    def target(self, pattern: str) -> Any:
        if pattern not in self._targets:
            self._targets[pattern] = compile_pattern(pattern, "LoRA target_modules")
        return self._targets[pattern]

    def saved(self, module: str) -> bool:
        return any(p.match(module) for p in self.save)

    def rank_for(self, name: str) -> int:
        for key, pattern, r in self.ranks:
            if name == key or name.endswith("." + key) or pattern.fullmatch(name):
                return r
        return self.default_rank


def patterns(spec: LoraSpec) -> Patterns:
    return Patterns(spec)


def matching(spec: LoraSpec) -> str:
    """What a deadline names when LoRA's patterns take too long: the user's patterns."""
    shown = [f"target_modules {quote(spec.targets, 40)}"] if isinstance(spec.targets, str) else []
    shown += [f"modules_to_save {quote(list(spec.modules_to_save), 40)}"] if spec.modules_to_save else []
    shown += [f"rank_pattern {quote([k for k, _ in spec.rank_pattern], 40)}"] if spec.rank_pattern else []
    return f"matching LoRA's {', '.join(shown) or 'targets'} against the model's module names"


def output_module(inv: ParamInventory) -> str | None:
    """The output embedding's module (PEFT's all-linear leaves it out): the head, tied or not."""
    for t in inv.tensors:
        if t.category == "head":
            return t.module
        for alias in t.tied_names:
            if alias.lower().startswith(HEAD_PREFIXES):
                return alias.rpartition(".")[0]
    return None


def output_module_name(model: Any) -> str | None:
    """A torch model's output embedding's module name (what all-linear leaves out), or None."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out_emb is None:
        return None
    return next((n for n, m in model.named_modules() if m is out_emb), None)


def apply(inv: ParamInventory, spec: LoraSpec) -> ParamInventory:
    """The inventory as PEFT leaves the model: base parameters frozen (renamed under base_layer where adapted),
    adapters after each adapted layer's own parameters, trainable copies of modules_to_save."""
    # the user's patterns are matched under the deadline, once per module; the rest runs without it (it is linear
    # in the tensors, and a slow first import on a loaded machine must not read as a runaway pattern)
    with deadline(REGEX_SECONDS, matching(spec)):
        found, saved_set = _matches(inv, spec)
    saved = saved_set.__contains__
    adapted = _apply(inv, spec, found, saved)
    return quantize_base(adapted, spec, _quantized_modules(inv, spec, saved)) if spec.quantize else adapted


def _matches(inv: ParamInventory, spec: LoraSpec) -> tuple[Resolved, frozenset[str]]:
    """What PEFT adapts (resolve) and the modules (tied aliases' among them) modules_to_save names."""
    modules: dict[str, str] = {}
    for t in inv.tensors:
        modules.setdefault(t.module, t.layer)
        for alias in t.tied_names:
            modules.setdefault(alias.rpartition(".")[0], t.layer if t.layer != "embedding" else "linear")
    found = resolve(spec, inv.family, list(modules.items()), [(t.name, t.module) for t in inv.tensors],
                    output_module(inv))
    pats = patterns(spec)
    return found, frozenset(m for m in modules if pats.saved(m))


def _apply(inv: ParamInventory, spec: LoraSpec, found: Resolved, saved: Any) -> ParamInventory:
    chosen, ranks = set(found.modules), found.ranks
    # lora.ParamWrapper nests one wrapper per adapted parameter of a module, the first innermost: the module's
    # own parameters sit under as many base_layer levels, each wrapper's adapters under those outside it
    wrapped: dict[str, list[ParamTensor]] = {}
    by_name = {t.name: t for t in inv.tensors}
    for name in found.params:
        wrapped.setdefault(by_name[name].module, []).append(by_name[name])
    by_module: dict[str, list[ParamTensor]] = {}
    for t in inv.tensors:
        by_module.setdefault(t.module, []).append(t)
    out: list[ParamTensor] = []
    tail: list[ParamTensor] = []  # trainable copies of tied aliases (a tied head), with the root's last tensors
    for t in inv.tensors:
        mod, leaf = t.module, t.name.rpartition(".")[2]
        if mod in wrapped:
            depth = len(wrapped[mod])
            out.append(replace(t, name=f"{mod}{'.base_layer' * depth}.{leaf}",
                               trainable=spec.bias == "all" and leaf == "bias"))
            if t is by_module[mod][-1]:
                for i, w in enumerate(wrapped[mod]):
                    out += param_adapters(w, ranks[w.name], f"{mod}{'.base_layer' * (depth - 1 - i)}")
            continue
        if mod in chosen:
            trainable = leaf == "bias" and spec.bias in ("all", "lora_only")
            out.append(replace(t, name=f"{mod}.base_layer.{leaf}", trainable=trainable))
            if t is by_module[mod][-1]:
                w = next(x for x in by_module[mod] if x.name.endswith(".weight"))
                fan_in, fan_out = (w.shape[0], w.shape[1]) if w.layer == "conv1d" else (w.shape[1], w.shape[0])
                r = ranks[mod]
                out.append(ParamTensor(f"{mod}.lora_A.default.weight", (r, fan_in), w.dtype, w.block, w.category,
                                       layer="linear"))
                out.append(ParamTensor(f"{mod}.lora_B.default.weight", (fan_out, r), w.dtype, w.block, w.category,
                                       layer="linear"))
            continue
        for alias in t.tied_names:  # PEFT deep-copies the module it wraps: the copy is no longer tied
            amod = alias.rpartition(".")[0]
            if saved(amod):
                tail.append(replace(t, name=f"{amod}.modules_to_save.default.{alias.rpartition('.')[2]}",
                                    trainable=True, tied_names=(), category="head"))
        if saved(mod):
            out.append(replace(t, name=f"{mod}.original_module.{leaf}", trainable=False))
            out.append(replace(t, name=f"{mod}.modules_to_save.default.{leaf}", trainable=True, tied_names=()))
            continue
        out.append(replace(t, trainable=spec.bias == "all" and leaf == "bias"))
    out += tail
    count = len(chosen) + len(found.params)
    notes = inv.notes + (f"{spec.describe()}: {count} adapted layers"
                         f"{f' ({len(found.params)} of them parameters: lora.ParamWrapper)' if found.params else ''}, "
                         f"{sum(t.numel for t in out if t.trainable):,} trainable parameters",)
    if found.params:
        notes += (param_note(found, [by_name[n] for n in found.params]),)
    elif found.spec.target_parameters:
        notes += (f"LoRA target_parameters {', '.join(found.spec.target_parameters)} match no parameter of this "
                  "model: PEFT warns and adapts the target modules alone, as here",)
    return replace(inv, tensors=tuple(out), notes=notes, param_adapted=found.params)


def param_adapters(w: ParamTensor, r: int, prefix: str) -> list[ParamTensor]:
    """lora.ParamWrapper's two adapters for one parameter (peft/tuners/lora/layer.py ParamWrapper
    _get_in_out_features and update_layer): a 3-D [experts, a, b] stack has in_features b and out_features a (the
    swap for a stack that is not is_transposed: every fused MoE of the converted families), a 2-D [out, in] weight
    one expert; lora_A is nn.Linear(in, r * experts), lora_B nn.Linear(r * experts, out), in the parameter's dtype
    (_move_adapter_to_device_of_base_layer)."""
    if len(w.shape) == 3:
        experts, fan_out, fan_in = w.shape
    elif len(w.shape) == 2:
        experts, (fan_out, fan_in) = 1, w.shape
    else:
        raise SettingsError(f"LoRA target_parameters {quote(w.name)} has {len(w.shape)} dimensions: PEFT's "
                            "ParamWrapper adapts 2-D and 3-D parameters only")
    return [ParamTensor(f"{prefix}.lora_A.default.weight", (r * experts, fan_in), w.dtype, w.block, w.category,
                        layer="linear"),
            ParamTensor(f"{prefix}.lora_B.default.weight", (fan_out, r * experts), w.dtype, w.block, w.category,
                        layer="linear")]


def param_note(found: Resolved, tensors: list[ParamTensor]) -> str:
    converted = " (PEFT's transformers-5 conversion moved the expert and router targets here)" \
        if found.spec.converted else ""
    stacks = [t for t in tensors if len(t.shape) == 3]
    return (f"LoRA on {len(tensors)} parameters{converted}: each forward of their module folds the adapters into "
            "a new copy of the whole parameter (torch parametrize, W + B·A, baddbmm for an expert stack), which "
            "autograd keeps for backward" + (f": {sum(t.numel for t in stacks):,} elements of {len(stacks)} "
                                             "expert stacks, in the activations" if stacks else ""))


def _quantized_modules(inv: ParamInventory, spec: LoraSpec, saved: Any) -> set[str]:
    """The modules whose weight bitsandbytes stores 4-bit, as transformers picks them at load, before PEFT
    (integrations/bitsandbytes.py replace_with_bnb_linear: every ``type(m) is nn.Linear`` and Conv1D, but
    quantizers/base.py get_keys_to_not_convert: tied weights, the module of the model's last parameter and the
    output embedding, and the class's _keep_in_fp32_modules: kept_in_fp32). Routers and fused MoE experts are not
    nn.Linear and stay as they are."""
    out_mod = output_module(inv)
    last = inv.tensors[-1].module if inv.tensors else None
    tied = {a.rpartition(".")[0] for t in inv.tensors for a in t.tied_names} | \
        {t.module for t in inv.tensors if t.tied_names}
    mods = {t.module for t in inv.tensors if t.layer in ("linear", "conv1d") and t.name.endswith(".weight")
            and t.module not in tied and t.module != out_mod and t.module != last
            and not kept_in_fp32(t.module, inv.keep_fp32_modules)}
    for m in sorted(mods):
        if saved(m):
            raise SettingsError(f"modules_to_save {quote(m)} is a 4-bit layer under --quantize-base: PEFT would train a "
                                "copy of its quantized weight, which has no gradient")
    if not mods:
        raise SettingsError("--quantize-base: the model has no nn.Linear layer bitsandbytes would quantize")
    return mods


def kept_in_fp32(module: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """Whether a module matches one of the class's _keep_in_fp32_modules, which transformers' bitsandbytes
    quantizer adds to the modules it does not convert (quantizers/base.py get_modules_to_not_convert), matched as
    quantizers_utils.should_convert_module matches: from the start up to a module boundary, as a regex with that
    boundary, or as a suffix (T5's "wo": every block's DenseReluDense.wo stays a plain Linear)."""
    import re

    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key) for key in patterns)


def quantized_weight(name: str, shape: tuple[int, ...], spec: LoraSpec, block: str,
                     category: str) -> list[ParamTensor]:
    """One linear weight as bitsandbytes 0.50 stores it 4-bit (functional.py quantize_4bit): the packed
    uint8 data ((n + 1) // 2 bytes, Params4bit [(n + 1) // 2, 1]) and its QuantState: the 16-entry nf4/fp4 code
    (get_4bit_type, fp32) and one absmax per 64-element block, fp32; with double quantization
    (compress_statistics) the absmax are themselves quantized to uint8 in 256-element blocks (quantize_blockwise),
    leaving state2's fp32 absmax, its own copy of the 256-entry dynamic code (code.to(device, copy=True)) and the
    fp32 offset (absmax.mean())."""
    n = math.prod(shape)
    blocks = -(-n // QUANT_BLOCK)
    q = f"{name}.quant_state"
    storage = spec.quant_storage
    # the packed codes: (n + 1) // (itemsize * 2) elements of the storage dtype (bitsandbytes 0.50 _ops.py
    # quantize_4bit's fake; the default kernel packs into uint8 and views it as quant_storage); in a float dtype a
    # frozen parameter FSDP and ZeRO-3 shard (``packs``: the weight's elements)
    packed = ParamTensor(name, ((n + 1) // (2 * dtype_bytes(storage)), 1), storage, block, category,
                         layer="linear", trainable=False, packs=n if storage != "uint8" else 0)
    out = [packed, ParamTensor(f"{q}.code", (16,), "float32", block, category, trainable=False)]
    if not spec.double_quant:
        return out + [ParamTensor(f"{q}.absmax", (blocks,), "float32", block, category, trainable=False)]
    return out + [ParamTensor(f"{q}.absmax", (blocks,), "uint8", block, category, trainable=False),
                  ParamTensor(f"{q}.offset", (), "float32", block, category, trainable=False),
                  ParamTensor(f"{q}.state2.absmax", (-(-blocks // QUANT_BLOCK2),), "float32", block, category,
                              trainable=False),
                  ParamTensor(f"{q}.state2.code", (256,), "float32", block, category, trainable=False)]


def quantize_base(inv: ParamInventory, spec: LoraSpec, modules: set[str]) -> ParamInventory:
    """The adapted inventory with ``modules``' weights (by their names before PEFT) moved to bitsandbytes'
    4-bit storage (inv.quantized), with their frozen biases in the compute dtype (each 4-bit layer's first
    forward casts its bias). With double quantization the process also
    holds bitsandbytes' one 256-entry fp32 dynamic map (functional.py name2qmap["dynamic"])."""
    keep: list[ParamTensor] = []
    quant: list[ParamTensor] = []
    numel = 0
    for t in inv.tensors:
        mod, leaf = t.module, t.name.rpartition(".")[2]
        orig = mod[:-len(".base_layer")] if mod.endswith(".base_layer") else mod
        if leaf == "weight" and orig in modules and not t.trainable:
            packed, *state = quantized_weight(t.name, t.shape, spec, t.block, t.category)
            if packed.packs:  # a float storage: a frozen parameter in the weight's place (its unit, its order)
                keep.append(replace(packed, unit=t.unit, shard_split=t.shard_split))
                quant += state
            else:
                quant += [packed, *state]
            numel += t.numel
        elif leaf == "bias" and orig in modules and not t.trainable:
            # Linear4bit.forward casts a bias to the compute dtype in place (bias.data = bias.data.to(x.dtype))
            quant.append(replace(t, dtype=spec.compute_dtype))
        else:
            keep.append(t)
    if spec.double_quant:
        quant.append(ParamTensor("bitsandbytes.functional.name2qmap.dynamic", (256,), "float32", ROOT_BLOCK,
                                 "other", trainable=False))
    stored = sum(t.nbytes for t in quant) + sum(t.nbytes for t in keep if t.packs)
    note = (f"{spec.quantize} base (bitsandbytes Linear4bit{', double quantization' if spec.double_quant else ''}"
            f"{', packed into ' + spec.quant_storage if spec.quant_storage != 'uint8' else ''}): "
            f"{len(modules)} linear layers, {numel:,} parameters in {stored:,} bytes")
    # transformers 5 fuses an MoE block's experts into 3-D nn.Parameters (gate_up_proj, down_proj): not nn.Linear,
    # so replace_with_bnb_linear (integrations/bitsandbytes.py) leaves them in the model's dtype, and PEFT's
    # target_modules cannot adapt them (its target_parameters can: lora.ParamWrapper, _apply)
    fused = [t for t in keep if len(t.shape) == 3 and not t.trainable]
    adapted = sum(1 for t in fused if _unwrapped(t.name) in inv.param_adapted)
    how = (f"; {adapted} of them carry LoRA adapters (lora.ParamWrapper)" if adapted else
           ", and no LoRA adapter is placed on them (target_modules cannot reach a parameter)")
    notes = (note,) + ((f"{sum(t.numel for t in fused):,} parameters of {len(fused)} fused MoE expert tensors "
                        "(3-D nn.Parameter, not nn.Linear) are not quantized: transformers' bitsandbytes "
                        f"integration converts nn.Linear only, so they stay frozen in the recipe's dtype{how}",)
                       if fused else ())
    kept = sorted({t.module for t in keep if t.layer == "linear" and kept_in_fp32(t.module, inv.keep_fp32_modules)})
    if kept:
        notes += (f"{len(kept)} linear layers matching the model's _keep_in_fp32_modules "
                  f"({', '.join(inv.keep_fp32_modules)}) stay unquantized in the recipe's dtype: transformers' "
                  "bitsandbytes quantizer does not convert them",)
    return replace(inv, tensors=tuple(keep), quantized=tuple(quant), quantized_params=numel,
                   notes=inv.notes + notes)


def _unwrapped(name: str) -> str:
    """A parameter's name before PEFT wrapped its module (every ".base_layer" taken out)."""
    return name.replace(".base_layer", "")


def read_adapter_config(path: str) -> LoraSpec:
    """A PEFT adapter_config.json (or the directory that holds one) as a LoraSpec."""
    from memplan.inputs import load_json, read_text

    p = Path(path)
    if p.is_dir():
        p = p / "adapter_config.json"
    data = load_json(read_text(p, "adapter config"), str(p), "PEFT adapter config")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: an adapter config is a JSON object")
    kind = str(data.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise ConfigError(f"{p}: peft_type {kind} is not modelled (memplan models LoRA and QLoRA)")
    if data.get("use_dora"):
        raise ConfigError(f"{p}: use_dora (DoRA) is not modelled: its magnitude vector and weight-norm step keep "
                          "other tensors than LoRA's")
    notes = []
    unknown = sorted(k for k in data if k not in _READ | _NO_MEMORY | {"use_dora"})
    if unknown:
        notes.append(f"adapter config keys not modelled: {', '.join(unknown)}")

    def num(key: str, default: Any, kind: type) -> Any:
        v = data.get(key, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
            raise ConfigError(f"{p}: {key} must be a number, got {quote(v)}")
        return kind(v)

    targets = data.get("target_modules")
    if isinstance(targets, list):
        if not all(isinstance(x, str) for x in targets):
            raise ConfigError(f"{p}: target_modules must be a list of module names or one pattern")
        targets = tuple(targets)
    elif targets is None:
        targets = ()
    elif not isinstance(targets, str):
        raise ConfigError(f"{p}: target_modules must be a list of module names or one pattern")
    elif targets.lower() == ALL_LINEAR:
        targets = ALL_LINEAR

    def names(key: str) -> tuple[str, ...]:
        v = data.get(key) or ()
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
            raise ConfigError(f"{p}: {key} must be a list of "
                              f"{'parameter' if key == 'target_parameters' else 'module'} names")
        return tuple(v)

    layers = data.get("layers_to_transform") or ()
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = (layers,)
    if not isinstance(layers, (list, tuple)) or not all(isinstance(x, int) for x in layers):
        raise ConfigError(f"{p}: layers_to_transform must be a layer index or a list of them")
    pattern = data.get("rank_pattern") or {}
    if not isinstance(pattern, dict) or not all(isinstance(v, int) and v > 0 for v in pattern.values()):
        raise ConfigError(f"{p}: rank_pattern must map module names to ranks")
    try:
        return LoraSpec(rank=num("r", 8, int), alpha=num("lora_alpha", 8, float), targets=targets,
                        dropout=num("lora_dropout", 0.0, float), bias=str(data.get("bias", "none")),
                        modules_to_save=names("modules_to_save"), layers_to_transform=tuple(layers),
                        exclude_modules=names("exclude_modules"),
                        rank_pattern=tuple(sorted(pattern.items())), source=str(p), notes=tuple(notes),
                        target_parameters=names("target_parameters"))
    except SettingsError as exc:
        raise ConfigError(f"{p}: {exc}") from None


def parse_targets(value: str | None) -> tuple[str, ...] | str:
    """--lora-targets: a comma-separated list of module names, or all-linear."""
    if value is None:
        return ()
    v = value.strip()
    if v.lower() == ALL_LINEAR:
        return ALL_LINEAR
    names = tuple(x.strip() for x in v.split(",") if x.strip())
    if not names:
        raise SettingsError("--lora-targets is empty; give module names (q_proj,v_proj) or all-linear")
    return names


def json_dumps(spec: LoraSpec) -> str:
    return json.dumps(spec.trace_fields(), sort_keys=True)
