"""A smaller config of the same architecture (validate scales a model down to run it; the tracer traces a model at
a depth of one or two blocks). Plain dict arithmetic on a config.json; no torch here."""

from __future__ import annotations

from typing import Any

from memplan.errors import SettingsError
from memplan.model.config import HEAD_KEYS, LAYER_KEYS, layer_count

#: config keys by meaning, across transformers families (first present wins)
_LAYER_KEYS = tuple(k for k in LAYER_KEYS if k != "decoder_layers")  # a decoder's count: _SECOND_LAYER_KEYS
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim", "emb_dim")  # DistilBERT's dim, XLM's emb_dim
_HEAD_KEYS = tuple(k for k in HEAD_KEYS if k != "decoder_attention_heads") + ("num_heads", "encoder_attention_heads")
_INTER_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "hidden_dim", "moe_intermediate_size",
               "shared_expert_intermediate_size",
               "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "shared_intermediate_size",
               "shared_experts_intermediate_size", "ffn_hidden_size", "expert_ffn_hidden_size")
#: an encoder-decoder's other stack and heads, scaled with the first (T5's num_decoder_layers, BART's encoder and
#: decoder layers and heads)
_SECOND_LAYER_KEYS = ("num_decoder_layers", "encoder_layers", "decoder_layers")
_SECOND_HEAD_KEYS = ("decoder_attention_heads",)


#: per-layer lists whose key does not name layers: Longformer's and LED's attention_window (a window per layer,
#: checked against num_hidden_layers / encoder_layers by LongformerConfig and LEDConfig)
PER_LAYER_NAMES = ("attention_window",)


def per_layer_keys(config: dict[str, Any], layers: int) -> list[str]:
    """The config's lists with one entry per layer: keys naming layers (layer_types, mlp_layer_types,
    num_attention_heads_per_layer, ...) or PER_LAYER_NAMES, whose list is ``layers`` long (not a list of layer
    indices)."""
    index = set(index_list_keys(config, layers))
    return [k for k, v in config.items() if ("layer" in k or k in PER_LAYER_NAMES) and isinstance(v, list)
            and len(v) == layers and layers > 1 and k not in index]


def index_list_keys(config: dict[str, Any], layers: int) -> list[str]:
    """The config's lists of layer indices: keys naming layers whose list holds whole numbers below ``layers``,
    strictly increasing (Mllama's cross_attention_layers, read as `layer_idx in config.cross_attention_layers`;
    Llama 4's moe_layers; Qwen-MoE's mlp_only_layers): the layers they name are built unlike the others."""
    return [k for k, v in config.items() if "layer" in k and isinstance(v, list) and v
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in v)
            and all(a < b for a, b in zip(v, v[1:]))]


def varied_index_keys(config: dict[str, Any], layers: int) -> list[str]:
    """index_list_keys naming some layers but not all: the blocks differ."""
    return [k for k in index_list_keys(config, layers) if len(config[k]) < layers]


def layer_index_keys(config: dict[str, Any]) -> list[str]:
    """The config's non-empty mappings keyed by layer index (keys naming layers whose keys are all whole numbers,
    Gemma 4's per_layer_config): settings that make those layers differ."""
    return [k for k, v in config.items() if "layer" in k and isinstance(v, dict) and v
            and all(isinstance(i, int) or (isinstance(i, str) and i.isdigit()) for i in v)]


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if config.get(k) is not None), None)


def scale_config(config: dict[str, Any], *, layers: int | None = None, hidden: int | None = None,
                 vocab: int | None = None) -> tuple[dict[str, Any], list[str]]:
    """A smaller config of the same architecture: fewer blocks, a narrower hidden size (head_dim kept when
    possible, MLP widths scaled by the same ratio), optionally a smaller vocabulary. Returns (config, changes)."""
    cfg = dict(config)
    changes: list[str] = []
    if layers is not None:
        key = _first(cfg, _LAYER_KEYS) or _first(cfg, _SECOND_LAYER_KEYS)
        if key is None and layer_count(cfg) is not None:  # a depth given by its per-layer lists alone
            old = layer_count(cfg)
            if layers != old:
                changes.append(f"layers {old} -> {layers}")
                for k in index_list_keys(cfg, old):
                    cfg[k] = [i for i in cfg[k] if i < layers]
                for k in per_layer_keys(cfg, old):
                    cfg[k] = cfg[k][:layers]
                if isinstance(cfg.get("hybrid_override_pattern"), str):
                    cfg["hybrid_override_pattern"] = cfg["hybrid_override_pattern"][:layers]
            key = ""
        if key is None:
            raise SettingsError("this config has no layer count to scale")
        if layers < 1:
            raise SettingsError(f"--layers must be at least 1, got {layers}")
        old = cfg[key] if key else layers  # the depth the per-layer lists follow (LED's encoder's windows)
        for k in _SECOND_LAYER_KEYS:  # an encoder-decoder's stacks each get ``layers`` blocks
            if isinstance(cfg.get(k), int) and cfg[k] != layers:
                changes.append(f"{k} {cfg[k]} -> {layers}")
                cfg[k] = layers
        if key and layers != old:
            if key not in _SECOND_LAYER_KEYS:
                changes.append(f"{key} {old} -> {layers}")
            cfg[key] = layers
            for k in ("first_k_dense_replace",):
                if k in cfg:
                    cfg[k] = min(cfg[k], layers)
            # a list of layer indices (cross_attention_layers, moe_layers): the indices of the layers kept
            for k in index_list_keys(cfg, old):
                cfg[k] = [i for i in cfg[k] if i < layers]
            # a list with an entry per layer (layer_types, mlp_layer_types, ...: transformers' configs check
            # their length against num_hidden_layers) keeps its first ``layers`` entries
            for k in per_layer_keys(cfg, old):
                cfg[k] = cfg[k][:layers]
            # overrides by layer index (Gemma 4's per_layer_config {"05": {...}}): those of the layers kept
            for k in layer_index_keys(cfg):
                cfg[k] = {i: v for i, v in cfg[k].items() if int(i) < layers}
    if hidden is not None:
        hkey = _first(cfg, _HIDDEN_KEYS)
        nkey = _first(cfg, _HEAD_KEYS)
        if hkey is None or nkey is None:
            raise SettingsError("this config has no hidden size / head count to scale")
        old_h, heads = int(cfg[hkey]), int(cfg[nkey])
        head_dim = int(cfg.get("head_dim") or cfg.get("d_kv") or old_h // heads)
        if hidden < 1 or hidden % head_dim and hidden % 2:
            raise SettingsError(f"--hidden {hidden} must be a positive multiple of head_dim {head_dim} (or even)")
        new_heads = max(1, hidden // head_dim) if hidden % head_dim == 0 else max(1, hidden // 64)
        if hidden % new_heads:
            raise SettingsError(f"--hidden {hidden} is not divisible into attention heads")
        kv = cfg.get("num_key_value_heads")
        if kv:
            group = max(1, heads // int(kv))
            new_kv = max(1, new_heads // group)
            while new_heads % new_kv:
                new_kv -= 1
            cfg["num_key_value_heads"] = new_kv
        ratio_num, ratio_den = hidden, old_h
        for k in _INTER_KEYS:
            if cfg.get(k):
                # to a multiple of 8 elements: the CPU grouped_mm kernel (MoE experts) wants 16-byte strides
                v = int(cfg[k]) * ratio_num // ratio_den
                cfg[k] = max(8, (v + 4) // 8 * 8)
        changes.append(f"{hkey} {old_h} -> {hidden}, {nkey} {heads} -> {new_heads}"
                       + (f", num_key_value_heads {kv} -> {cfg['num_key_value_heads']}" if kv else ""))
        cfg[hkey], cfg[nkey] = hidden, new_heads
        # widths that add up to the hidden size scale with it (LayoutLMv3's spatial embeddings: 4 x coordinate_size
        # + 2 x shape_size, concatenated into the hidden states)
        c, sh = cfg.get("coordinate_size"), cfg.get("shape_size")
        if isinstance(c, int) and isinstance(sh, int) and 4 * c + 2 * sh == old_h and hidden % 2 == 0:
            c = c * hidden // old_h
            cfg["coordinate_size"], cfg["shape_size"] = c, (hidden - 4 * c) // 2
        # other widths the config sets to the hidden size (DeBERTa-v2's pooler_hidden_size, an embedding_size
        # equal to it) follow it: the layers they size read the hidden states
        for k, v in list(cfg.items()):
            if k != hkey and v == old_h and isinstance(v, int) and (k.endswith("hidden_size") or
                                                                      k == "embedding_size"):
                cfg[k] = hidden
                changes.append(f"{k} {old_h} -> {hidden}")
        for k in _SECOND_HEAD_KEYS:
            if k in cfg:
                cfg[k] = new_heads
        for k in ("head_dim", "d_kv"):  # T5's d_kv is its head dim
            if k in cfg and cfg[k]:
                cfg[k] = hidden // new_heads
    if vocab is not None:
        vkey = "vocab_size"
        if vocab < 2:
            raise SettingsError(f"--vocab must be at least 2, got {vocab}")
        changes.append(f"vocab_size {cfg.get(vkey)} -> {vocab}")
        cfg[vkey] = vocab
        if isinstance(cfg.get("decoder_vocab_size"), int):  # Marian's target vocabulary, its own LM head's
            changes.append(f"decoder_vocab_size {cfg['decoder_vocab_size']} -> {vocab}")
            cfg["decoder_vocab_size"] = vocab
        for k in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
            v = cfg.get(k)
            if isinstance(v, int) and v >= vocab:
                cfg[k] = vocab - 1
            elif isinstance(v, list):
                cfg[k] = [min(x, vocab - 1) for x in v]
    return cfg, changes
