"""What a config.json says, read the same way by every builder: its dtype, the dimensions the activation and
buffer terms need, and the checks a config passes before any builder (or a trace) sees it."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from memplan.errors import ConfigError
from memplan.inputs import quote
from memplan.units import normalize_dtype


def config_dtype(config: Mapping[str, Any]) -> str:
    """The stored dtype a config declares (transformers 5 writes "dtype", 4.x "torch_dtype"); float32 if none."""
    raw = config.get("dtype") or config.get("torch_dtype") or "float32"
    try:
        return normalize_dtype(raw)
    except Exception as exc:
        raise ConfigError(f"config dtype {quote(raw)} is not a known dtype") from exc


#: Families whose MLP is fc -> activation -> projection (no gate).
PLAIN_MLP_FAMILIES = frozenset({"gpt2", "gpt_neox", "falcon", "gpt_bigcode", "gptj", "opt", "bloom", "phi"})


#: the config keys of the block count and of the attention heads across families, first present wins (MPT's
#: n_layers and n_heads; an encoder-decoder family's decoder alone, BartForCausalLM's: its decoder's)
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "decoder_attention_heads")


#: per-layer lists a config may give its depth by alone (NemotronHConfig's num_hidden_layers is
#: len(layers_block_type), a property its to_dict leaves out)
LAYER_LISTS = ("layers_block_type", "layer_types", "block_types")


def layer_count(config: Mapping[str, Any]) -> int | None:
    """The config's block count: the first of LAYER_KEYS given, else the length of a per-layer list (LAYER_LISTS,
    or Nemotron-H's hybrid_override_pattern, a character a layer); None where it gives neither."""
    for k in LAYER_KEYS:
        v = config.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    for k in LAYER_LISTS:
        v = config.get(k)
        if isinstance(v, list) and v:
            return len(v)
    v = config.get("hybrid_override_pattern")
    return len(v) if isinstance(v, str) and v else None


def model_dims(config: Mapping[str, Any]) -> dict[str, int]:
    """Dimensions the activation / buffer terms need, under the names of most families (a vision-language
    model's from its language model's text_config, where the top level does not give them)."""
    text = config.get("text_config")
    if isinstance(text, Mapping):
        config = {**text, **{k: v for k, v in config.items() if k != "text_config"}}
    keys = {"hidden_size": ("hidden_size", "n_embd", "d_model"),
            # an encoder-decoder family's decoder alone (BartForCausalLM, MBart's, Marian's: the decoder's sizes)
            "num_layers": LAYER_KEYS,
            "num_heads": HEAD_KEYS,
            "vocab_size": ("vocab_size",),
            "intermediate_size": ("intermediate_size", "n_inner", "ffn_hidden_size", "decoder_ffn_dim"),
            "max_positions": ("max_position_embeddings", "n_positions")}
    dims: dict[str, int] = {}
    for dim, names in keys.items():
        for n in names:
            v = config.get(n)
            if isinstance(v, int) and not isinstance(v, bool):
                dims[dim] = v
                break
    if "num_layers" not in dims and (n := layer_count(config)) is not None:
        dims["num_layers"] = n
    # Two-matrix GELU MLPs (fc -> act -> proj) save fewer activations than gated (SwiGLU/GeGLU) ones.
    dims["gated_mlp"] = 0 if config.get("model_type") in PLAIN_MLP_FAMILIES else 1
    kv = config.get("num_key_value_heads")
    if isinstance(kv, int):
        dims["num_kv_heads"] = kv
    k = config.get("num_experts_per_tok")  # MoE: the routed experts each token goes to (top-k)
    if isinstance(k, int) and not isinstance(k, bool):
        dims["experts_per_token"] = k
    return dims


#: structural sizes a config may give, by meaning, with the largest value any real model approaches times a
#: wide margin: past them an inventory or a trace would take hours (a 10^12-layer config), so they are refused
_STRUCTURAL = {"hidden_size": 1 << 20, "n_embd": 1 << 20, "d_model": 1 << 20, "num_hidden_layers": 100_000,
               "n_layer": 100_000, "num_layers": 100_000, "n_layers": 100_000, "num_attention_heads": 1 << 16,
               "n_head": 1 << 16, "n_heads": 1 << 16,
               "num_key_value_heads": 1 << 16, "head_dim": 1 << 16, "vocab_size": 1 << 31,
               "intermediate_size": 1 << 24, "n_inner": 1 << 24, "moe_intermediate_size": 1 << 24,
               "num_local_experts": 1 << 16, "num_experts": 1 << 16, "n_routed_experts": 1 << 16,
               "num_experts_per_tok": 1 << 16, "max_position_embeddings": 1 << 34, "n_positions": 1 << 34}
#: flags a config may give, which transformers reads as booleans
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_bias", "bias")


def check_config(config: Mapping[str, Any], built: Collection[str] = ()) -> None:
    """The checks every builder applies to a config.json before building (analytic, meta device, or a trace):
    structural sizes are positive integers within reach of a real model, flags are booleans, the attention
    heads divide the hidden size where no head_dim is given and the key/value heads divide the heads (as
    transformers' attention modules require). ``built``: the model types memplan builds from their fields
    (model/families.py BUILDERS), whose core sizes must be given."""
    for key, most in _STRUCTURAL.items():
        v = config.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"config field {quote(key)} must be a positive integer, got {quote(v)}")
        if v > most:
            raise ConfigError(f"config field {quote(key)} is {v:,}, more than any model memplan can size ({most:,})")
    for key in _FLAGS:
        v = config.get(key)
        if v is not None and not isinstance(v, bool):
            raise ConfigError(f"config field {quote(key)} must be true or false, got {quote(v)}")
    hidden = next((config[k] for k in ("hidden_size", "n_embd", "d_model") if config.get(k)), None)
    heads = next((config[k] for k in ("num_attention_heads", "n_head", "n_heads") if config.get(k)), None)
    # multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) sizes its heads by qk_nope_head_dim,
    # qk_rope_head_dim and v_head_dim, not hidden / heads (modeling_deepseek_v3.py DeepseekV3Attention)
    mla = config.get("qk_nope_head_dim") is not None or config.get("kv_lora_rank") is not None
    if hidden and heads and not config.get("head_dim") and not mla and hidden % heads:
        raise ConfigError(f"the hidden size ({hidden}) is not a multiple of the number of attention heads ({heads}), "
                          "and the config gives no head_dim")
    kv = config.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ConfigError(f"num_key_value_heads ({kv}) must divide num_attention_heads ({heads})")
    _check_core_sizes(config, built)
    for key in ("rope_scaling", "rope_parameters"):
        if config.get(key) is not None:
            _check_rope(config[key], key)


#: the model types memplan builds from their config fields (model/families.py BUILDERS) and the names of the
#: three sizes every one of them declares
_CORE = {"hidden size": ("hidden_size", "n_embd", "d_model"), "layer count": ("num_hidden_layers", "n_layer"),
         "attention head count": ("num_attention_heads", "n_head")}


def _check_core_sizes(config: Mapping[str, Any], built: Collection[str]) -> None:
    """A config of a family memplan builds itself must give its hidden size, layer count and head count: without
    them transformers' config class would fill in its defaults (LlamaConfig: a 7B model's 4096 x 32 x 32), which
    sizes some other model than the file's."""
    if config.get("model_type") not in built:
        return
    missing = [f"{what} ({' or '.join(names)})" for what, names in _CORE.items()
               if not any(config.get(n) is not None for n in names)]
    if missing:
        raise ConfigError(f"config.json of model_type {quote(config.get('model_type'))} gives no {', '.join(missing)}: "
                          "memplan will not size the model from transformers' defaults; give them")


#: rope types transformers 5 builds (modeling_rope_utils.py ROPE_INIT_FUNCTIONS, with "default" and Qwen2-VL's
#: "mrope"), and those whose validation requires a "factor" (_validate_linear/dynamic/yarn/llama3_rope_parameters)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional", "mrope")
ROPE_NEEDS_FACTOR = ("linear", "dynamic", "yarn", "llama3")


def _check_rope(value: Any, key: str) -> None:
    """rope_scaling / rope_parameters as transformers 5 takes them: a mapping (its strict dataclass field refuses
    anything else) with a known rope type and the factor that type requires, or one such mapping per layer type
    (Gemma 3's full_attention / sliding_attention)."""
    if not isinstance(value, dict):
        raise ConfigError(f"config field {key} must be a mapping (rope_type, factor, ...) or null, got {quote(value)}")
    if value and "rope_type" not in value and "type" not in value and all(isinstance(v, dict) for v in value.values()):
        for sub in value.values():  # one per layer type
            _check_rope(sub, key)
        return
    kind = value.get("rope_type", value.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"config field {key}: rope type {quote(kind)} is not one transformers builds "
                          f"({', '.join(ROPE_TYPES)})")
    factor = value.get("factor")
    if kind in ROPE_NEEDS_FACTOR and factor is None:
        raise ConfigError(f"config field {key}: rope type {kind} needs a factor (transformers: 'Missing required "
                          "keys')")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                               or not 0 < factor < float("inf")):
        raise ConfigError(f"config field {key}: factor must be a positive number, got {quote(factor)}")
