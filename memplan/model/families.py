"""Analytic ParamInventory builders: the parameter tensors of common families, from config.json alone.

Each builder mirrors the module tree of the transformers 5.x modeling code for its family (the
``__init__`` of the attention / MLP / decoder-layer classes in ``transformers/models/<family>/modeling_*.py``),
tensor by tensor and in module order, so that the result equals what instantiating the model on the meta
device gives (tests check names, shapes and owning blocks for every preset). No torch, no transformers: this is
the fast path of ``memplan estimate <preset>``.

Config fields a config.json may omit take the default of the transformers config class; ``FAMILY_DEFAULTS``
lists them and a test compares them with ``AutoConfig.for_model(model_type)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from memplan.errors import ConfigError
from memplan.inputs import quote
from memplan.model.config import config_dtype, model_dims
from memplan.model.inventory import ROOT_BLOCK, ParamInventory, ParamTensor, classify

#: Defaults of the transformers 5.x config classes for the fields the builders read.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None,
              "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "tie_word_embeddings": False},
    "mixtral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "tie_word_embeddings": False,
                "num_local_experts": 8},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None,
              "tie_word_embeddings": False},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None,
              "tie_word_embeddings": False, "attention_bias": False},
    "qwen2_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                  "num_attention_heads": 16, "num_key_value_heads": None, "head_dim": None,
                  "tie_word_embeddings": False, "num_experts": 60, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "qkv_bias": True},
    "qwen3_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": None,
                  "tie_word_embeddings": False, "attention_bias": False, "num_experts": 128,
                  "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "gemma": {"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "tie_word_embeddings": True,
              "attention_bias": False},
    "gemma2": {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True,
               "attention_bias": False},
    "phi3": {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": None, "tie_word_embeddings": False},
    "gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
             "tie_word_embeddings": True, "add_cross_attention": False},
    "gpt_neox": {"vocab_size": 50432, "hidden_size": 6144, "intermediate_size": 24576, "num_hidden_layers": 44,
                 "num_attention_heads": 64, "tie_word_embeddings": False, "attention_bias": True},
    "falcon": {"vocab_size": 65024, "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71,
               "num_kv_heads": None, "tie_word_embeddings": True, "new_decoder_architecture": False,
               "multi_query": True, "parallel_attn": True, "bias": False, "ffn_hidden_size": None,
               "num_ln_in_parallel_attn": None},
    "deepseek_v3": {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "tie_word_embeddings": False, "attention_bias": False,
                    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                    "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128},
}


class _Cfg:
    """A config.json dict with the family's defaults behind it; missing required fields are a ConfigError."""

    def __init__(self, raw: Mapping[str, Any], family: str):
        self.raw, self.family = raw, family
        self.defaults = FAMILY_DEFAULTS[family]

    def __getitem__(self, key: str) -> Any:
        if key in self.raw:
            return self.raw[key]
        if key in self.defaults:
            return self.defaults[key]
        raise ConfigError(f"config for {self.family} has no field {quote(key)}")

    def int(self, key: str, default: int | None = None) -> int:
        value = self[key] if default is None else (self[key] if self[key] is not None else default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"config field {quote(key)} must be a non-negative integer, got {quote(value)}")
        return value

    def pos(self, key: str, default: int | None = None) -> int:
        value = self.int(key, default)
        if value <= 0:
            raise ConfigError(f"config field {quote(key)} must be a positive integer, got {quote(value)}")
        return value

    def head_dim(self) -> int:
        hd = self.raw.get("head_dim", self.defaults.get("head_dim"))
        if hd:
            return self.pos("head_dim")
        heads = self.pos("num_attention_heads")
        return self.pos("hidden_size") // heads

    def kv_heads(self) -> int:
        return self.pos("num_key_value_heads", self.pos("num_attention_heads"))


class _Emitter:
    """Collects tensors in module order."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.tensors: list[ParamTensor] = []
        self.buffers: list[ParamTensor] = []
        self.block = ROOT_BLOCK

    def buffer(self, name: str, *shape: int, dtype: str = "float32") -> None:
        """A module buffer (ParamInventory.buffers), floating ones as built in fp32."""
        self.buffers.append(ParamTensor(name, tuple(shape), dtype, self.block, classify(name)))

    def rotary(self, name: str, dim: int) -> None:
        """transformers 5's rotary embedding module: inv_freq and original_inv_freq, non-persistent fp32 buffers
        of ceil(dim / 2) frequencies each (modeling_rope_utils.py _compute_default_rope_parameters: arange(0, dim,
        2); the other rope types make the same length)."""
        self.buffer(f"{name}.inv_freq", (dim + 1) // 2)
        self.buffer(f"{name}.original_inv_freq", (dim + 1) // 2)

    def param(self, name: str, *shape: int, tied_names: tuple[str, ...] = (), layer: str = "") -> None:
        self.tensors.append(ParamTensor(name, tuple(shape), self.dtype, self.block, classify(name), tied_names,
                                        layer))

    def linear(self, name: str, fan_in: int, fan_out: int, bias: bool = False) -> None:
        """nn.Linear: weight [out, in], bias [out]."""
        self.param(f"{name}.weight", fan_out, fan_in, layer="linear")
        if bias:
            self.param(f"{name}.bias", fan_out, layer="linear")

    def conv1d(self, name: str, fan_in: int, fan_out: int) -> None:
        """transformers' GPT-2 Conv1D: weight [in, out] and always a bias."""
        self.param(f"{name}.weight", fan_in, fan_out, layer="conv1d")
        self.param(f"{name}.bias", fan_out, layer="conv1d")

    def norm(self, name: str, dim: int, bias: bool = False) -> None:
        self.param(f"{name}.weight", dim)
        if bias:
            self.param(f"{name}.bias", dim)

    def embedding_and_head(self, embed: str, head: str, vocab: int, hidden: int, tied: bool) -> None:
        """The input embedding; the head either aliases it (tied) or is emitted later by ``head``."""
        self.param(f"{embed}.weight", vocab, hidden, tied_names=(f"{head}.weight",) if tied else (), layer="embedding")


def _rope_dim(c: _Cfg, head_dim: int) -> int:
    """The rotated part of a head: head_dim x partial_rotary_factor (top level, or in rope_parameters /
    rope_scaling), GPT-NeoX's rotary_pct (default 0.25) where the config gives no factor."""
    factor = c.raw.get("partial_rotary_factor")
    for key in ("rope_parameters", "rope_scaling"):
        sub = c.raw.get(key)
        if factor is None and isinstance(sub, Mapping):
            factor = sub.get("partial_rotary_factor")
    if factor is None:
        factor = c.raw.get("rotary_pct", 0.25) if c.family == "gpt_neox" else 1.0
    return int(head_dim * float(factor))


def _gated_mlp(e: _Emitter, p: str, hidden: int, inter: int, bias: bool = False) -> None:
    e.linear(f"{p}.gate_proj", hidden, inter, bias)
    e.linear(f"{p}.up_proj", hidden, inter, bias)
    e.linear(f"{p}.down_proj", inter, hidden, bias)


def _gqa(e: _Emitter, p: str, c: _Cfg, qkv_bias: bool, o_bias: bool, qk_norm: bool = False) -> None:
    hidden, heads, kv, hd = c.pos("hidden_size"), c.pos("num_attention_heads"), c.kv_heads(), c.head_dim()
    e.linear(f"{p}.q_proj", hidden, heads * hd, qkv_bias)
    e.linear(f"{p}.k_proj", hidden, kv * hd, qkv_bias)
    e.linear(f"{p}.v_proj", hidden, kv * hd, qkv_bias)
    e.linear(f"{p}.o_proj", heads * hd, hidden, o_bias)
    if qk_norm:
        e.norm(f"{p}.q_norm", hd)
        e.norm(f"{p}.k_norm", hd)


def _experts(e: _Emitter, p: str, n: int, hidden: int, inter: int) -> None:
    """transformers 5.x fused experts: 3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    e.param(f"{p}.gate_up_proj", n, 2 * inter, hidden)
    e.param(f"{p}.down_proj", n, hidden, inter)


def _decoder(c: _Cfg, e: _Emitter, layer: Callable[[str, int], None], final_norm: bool = True,
             prefix: str = "model") -> None:
    """The common skeleton: embed_tokens, layers.N (one block each), norm, lm_head (tied or not)."""
    hidden, vocab = c.pos("hidden_size"), c.pos("vocab_size")
    tied = bool(c["tie_word_embeddings"])
    e.embedding_and_head(f"{prefix}.embed_tokens", "lm_head", vocab, hidden, tied)
    for i in range(c.int("num_hidden_layers")):
        e.block = f"{prefix}.layers.{i}"
        layer(f"{prefix}.layers.{i}", i)
    e.block = ROOT_BLOCK
    if final_norm:
        e.norm(f"{prefix}.norm", hidden)
    if not tied:
        e.linear("lm_head", hidden, vocab)


def _llama_like(c: _Cfg, e: _Emitter) -> None:
    fam = c.family
    hidden, inter = c.pos("hidden_size"), c.pos("intermediate_size")
    # q/k/v bias: Qwen2 always, Mistral never, the others per `attention_bias`; o_proj: never for Qwen2.
    qkv_bias = {"qwen2": True, "mistral": False}.get(fam, bool(c.raw.get("attention_bias", False)))
    o_bias = fam != "qwen2" and qkv_bias
    mlp_bias = fam == "llama" and bool(c["mlp_bias"])

    def layer(p: str, i: int) -> None:
        _gqa(e, f"{p}.self_attn", c, qkv_bias, o_bias, qk_norm=fam == "qwen3")
        _gated_mlp(e, f"{p}.mlp", hidden, inter, mlp_bias)
        e.norm(f"{p}.input_layernorm", hidden)
        e.norm(f"{p}.post_attention_layernorm", hidden)
        if fam == "gemma2":
            e.norm(f"{p}.pre_feedforward_layernorm", hidden)
            e.norm(f"{p}.post_feedforward_layernorm", hidden)

    if fam in ("gemma", "gemma2"):  # GemmaTextScaledWordEmbedding's sqrt(hidden) scale, a 0-d buffer
        e.buffer("model.embed_tokens.embed_scale")
    _decoder(c, e, layer)
    e.rotary("model.rotary_emb", _rope_dim(c, c.head_dim()))


def _mixtral(c: _Cfg, e: _Emitter) -> None:
    hidden, inter, n = c.pos("hidden_size"), c.pos("intermediate_size"), c.pos("num_local_experts")

    def layer(p: str, i: int) -> None:
        _gqa(e, f"{p}.self_attn", c, False, False)
        e.param(f"{p}.mlp.gate.weight", n, hidden)
        _experts(e, f"{p}.mlp.experts", n, hidden, inter)
        e.norm(f"{p}.input_layernorm", hidden)
        e.norm(f"{p}.post_attention_layernorm", hidden)

    _decoder(c, e, layer)
    e.rotary("model.rotary_emb", _rope_dim(c, c.head_dim()))


def _qwen_moe(c: _Cfg, e: _Emitter) -> None:
    qwen3 = c.family == "qwen3_moe"
    hidden, n = c.pos("hidden_size"), c.int("num_experts")
    moe_inter, step = c.pos("moe_intermediate_size"), c.pos("decoder_sparse_step")
    only_dense = set(c["mlp_only_layers"] or [])
    qkv_bias = bool(c["attention_bias"]) if qwen3 else bool(c["qkv_bias"])

    def layer(p: str, i: int) -> None:
        _gqa(e, f"{p}.self_attn", c, qkv_bias, qwen3 and qkv_bias, qk_norm=qwen3)
        if i not in only_dense and n > 0 and (i + 1) % step == 0:
            if qwen3:  # Qwen3MoeSparseMoeBlock: experts, then gate
                _experts(e, f"{p}.mlp.experts", n, hidden, moe_inter)
                e.param(f"{p}.mlp.gate.weight", n, hidden)
            else:  # Qwen2MoeSparseMoeBlock: gate, experts, shared_expert, shared_expert_gate
                e.param(f"{p}.mlp.gate.weight", n, hidden)
                _experts(e, f"{p}.mlp.experts", n, hidden, moe_inter)
                _gated_mlp(e, f"{p}.mlp.shared_expert", hidden, c.pos("shared_expert_intermediate_size"))
                e.linear(f"{p}.mlp.shared_expert_gate", hidden, 1)
        else:
            _gated_mlp(e, f"{p}.mlp", hidden, c.pos("intermediate_size"))
        e.norm(f"{p}.input_layernorm", hidden)
        e.norm(f"{p}.post_attention_layernorm", hidden)

    _decoder(c, e, layer)
    e.rotary("model.rotary_emb", _rope_dim(c, c.head_dim()))


def _deepseek_v3(c: _Cfg, e: _Emitter) -> None:
    hidden, heads = c.pos("hidden_size"), c.pos("num_attention_heads")
    nope, rope, v_dim = c.pos("qk_nope_head_dim"), c.int("qk_rope_head_dim"), c.pos("v_head_dim")
    q_lora, kv_lora = c["q_lora_rank"], c.pos("kv_lora_rank")
    bias = bool(c["attention_bias"])
    n_routed, n_shared = c.pos("n_routed_experts"), c.int("n_shared_experts")
    moe_inter, first_dense = c.pos("moe_intermediate_size"), c.int("first_k_dense_replace")

    def layer(p: str, i: int) -> None:
        a = f"{p}.self_attn"
        if q_lora is None:
            e.linear(f"{a}.q_proj", hidden, heads * (nope + rope))
        else:
            e.linear(f"{a}.q_a_proj", hidden, c.pos("q_lora_rank"), bias)
            e.norm(f"{a}.q_a_layernorm", c.pos("q_lora_rank"))
            e.linear(f"{a}.q_b_proj", c.pos("q_lora_rank"), heads * (nope + rope))
        e.linear(f"{a}.kv_a_proj_with_mqa", hidden, kv_lora + rope, bias)
        e.norm(f"{a}.kv_a_layernorm", kv_lora)
        e.linear(f"{a}.kv_b_proj", kv_lora, heads * (nope + v_dim))
        e.linear(f"{a}.o_proj", heads * v_dim, hidden, bias)
        if i >= first_dense:  # DeepseekV3MoE: experts, gate (router), shared_experts
            _experts(e, f"{p}.mlp.experts", n_routed, hidden, moe_inter)
            e.param(f"{p}.mlp.gate.weight", n_routed, hidden)
            e.buffer(f"{p}.mlp.gate.e_score_correction_bias", n_routed)  # DeepseekV3TopkRouter's, fp32
            _gated_mlp(e, f"{p}.mlp.shared_experts", hidden, moe_inter * n_shared)
        else:
            _gated_mlp(e, f"{p}.mlp", hidden, c.pos("intermediate_size"))
        e.norm(f"{p}.input_layernorm", hidden)
        e.norm(f"{p}.post_attention_layernorm", hidden)

    _decoder(c, e, layer)
    e.rotary("model.rotary_emb", _rope_dim(c, rope))


def _phi3(c: _Cfg, e: _Emitter) -> None:
    hidden, inter, heads, kv = c.pos("hidden_size"), c.pos("intermediate_size"), c.pos("num_attention_heads"), c.kv_heads()
    hd = c.head_dim()

    def layer(p: str, i: int) -> None:
        e.linear(f"{p}.self_attn.o_proj", heads * hd, hidden)
        e.linear(f"{p}.self_attn.qkv_proj", hidden, heads * hd + 2 * kv * hd)
        e.linear(f"{p}.mlp.gate_up_proj", hidden, 2 * inter)
        e.linear(f"{p}.mlp.down_proj", inter, hidden)
        e.norm(f"{p}.input_layernorm", hidden)
        e.norm(f"{p}.post_attention_layernorm", hidden)

    _decoder(c, e, layer)
    e.rotary("model.rotary_emb", _rope_dim(c, hd))


def _gpt2(c: _Cfg, e: _Emitter) -> None:
    hidden, vocab, layers = c.pos("n_embd"), c.pos("vocab_size"), c.int("n_layer")
    inner = c["n_inner"] or 4 * hidden
    tied = bool(c["tie_word_embeddings"])
    e.embedding_and_head("transformer.wte", "lm_head", vocab, hidden, tied)
    e.param("transformer.wpe.weight", c.pos("n_positions"), hidden, layer="embedding")
    for i in range(layers):
        p = e.block = f"transformer.h.{i}"
        e.norm(f"{p}.ln_1", hidden, bias=True)
        e.conv1d(f"{p}.attn.c_attn", hidden, 3 * hidden)
        e.conv1d(f"{p}.attn.c_proj", hidden, hidden)
        e.norm(f"{p}.ln_2", hidden, bias=True)
        if c["add_cross_attention"]:
            e.conv1d(f"{p}.crossattention.c_attn", hidden, 2 * hidden)
            e.conv1d(f"{p}.crossattention.q_attn", hidden, hidden)
            e.conv1d(f"{p}.crossattention.c_proj", hidden, hidden)
            e.norm(f"{p}.ln_cross_attn", hidden, bias=True)
        e.conv1d(f"{p}.mlp.c_fc", hidden, inner)
        e.conv1d(f"{p}.mlp.c_proj", inner, hidden)
    e.block = ROOT_BLOCK
    e.norm("transformer.ln_f", hidden, bias=True)
    if not tied:
        e.linear("lm_head", hidden, vocab)


def _gpt_neox(c: _Cfg, e: _Emitter) -> None:
    hidden, inter, vocab = c.pos("hidden_size"), c.pos("intermediate_size"), c.pos("vocab_size")
    bias, tied = bool(c["attention_bias"]), bool(c["tie_word_embeddings"])
    e.embedding_and_head("gpt_neox.embed_in", "lm_head", vocab, hidden, tied)
    for i in range(c.int("num_hidden_layers")):
        p = e.block = f"gpt_neox.layers.{i}"
        e.norm(f"{p}.input_layernorm", hidden, bias=True)
        e.norm(f"{p}.post_attention_layernorm", hidden, bias=True)
        e.linear(f"{p}.attention.query_key_value", hidden, 3 * hidden, bias)
        e.linear(f"{p}.attention.dense", hidden, hidden, bias)
        e.linear(f"{p}.mlp.dense_h_to_4h", hidden, inter, True)
        e.linear(f"{p}.mlp.dense_4h_to_h", inter, hidden, True)
    e.block = ROOT_BLOCK
    e.norm("gpt_neox.final_layer_norm", hidden, bias=True)
    if not tied:
        e.linear("lm_head", hidden, vocab)
    e.rotary("gpt_neox.rotary_emb", _rope_dim(c, hidden // c.pos("num_attention_heads")))


def _falcon(c: _Cfg, e: _Emitter) -> None:
    hidden, heads, vocab = c.pos("hidden_size"), c.pos("num_attention_heads"), c.pos("vocab_size")
    new_arch, mq, bias = bool(c["new_decoder_architecture"]), bool(c["multi_query"]), bool(c["bias"])
    tied = bool(c["tie_word_embeddings"])
    kv_heads = c.pos("num_kv_heads", heads)
    hd = hidden // heads
    ffn = c.pos("ffn_hidden_size", 4 * hidden)
    # FalconAttention: fused query_key_value sized by the attention variant.
    if new_arch:
        qkv_out = (kv_heads * 2 + heads) * hd
    elif mq:
        qkv_out = hidden + 2 * hd
    else:
        qkv_out = 3 * hidden
    e.embedding_and_head("transformer.word_embeddings", "lm_head", vocab, hidden, tied)
    for i in range(c.int("num_hidden_layers")):
        p = e.block = f"transformer.h.{i}"
        e.linear(f"{p}.self_attention.query_key_value", hidden, qkv_out, bias)
        e.linear(f"{p}.self_attention.dense", hidden, hidden, bias)
        e.linear(f"{p}.mlp.dense_h_to_4h", hidden, ffn, bias)
        e.linear(f"{p}.mlp.dense_4h_to_h", ffn, hidden, bias)
        # FalconDecoderLayer: layer norms by architecture (modeling_falcon.py, FalconDecoderLayer.__init__).
        n_ln = c["num_ln_in_parallel_attn"]
        if n_ln is None and new_arch:
            n_ln = 2
        if not c["parallel_attn"]:
            e.norm(f"{p}.post_attention_layernorm", hidden, bias=True)
            e.norm(f"{p}.input_layernorm", hidden, bias=True)
        elif n_ln == 2:
            e.norm(f"{p}.ln_attn", hidden, bias=True)
            e.norm(f"{p}.ln_mlp", hidden, bias=True)
        else:
            e.norm(f"{p}.input_layernorm", hidden, bias=True)
    e.block = ROOT_BLOCK
    e.norm("transformer.ln_f", hidden, bias=True)
    if not tied:
        e.linear("lm_head", hidden, vocab)
    e.rotary("transformer.rotary_emb", _rope_dim(c, hd))  # FalconModel makes it with ALiBi too (unused then)


BUILDERS: dict[str, Callable[[_Cfg, _Emitter], None]] = {
    "llama": _llama_like, "mistral": _llama_like, "qwen2": _llama_like, "qwen3": _llama_like,
    "gemma": _llama_like, "gemma2": _llama_like, "mixtral": _mixtral, "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe, "deepseek_v3": _deepseek_v3, "phi3": _phi3, "gpt2": _gpt2, "gpt_neox": _gpt_neox,
    "falcon": _falcon,
}


def defaults_note(config: Mapping[str, Any]) -> list[str]:
    """A note for the sizes a config leaves to its family's defaults (transformers' config class supplies them)."""
    defaults = FAMILY_DEFAULTS.get(config.get("model_type"), {})
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "intermediate_size") if k in defaults and defaults[k] is not None and k not in config]
    if not missing:
        return []
    return [f"config.json gives no {', '.join(missing)}: {config.get('model_type')}'s defaults used, as "
            f"transformers' config class does ({', '.join(f'{k} {defaults[k]}' for k in missing)})"]


def supports(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") in BUILDERS


def build_analytic(config: Mapping[str, Any], model_name: str, source: str) -> ParamInventory:
    """Inventory from a config.json dict for a family in BUILDERS; ConfigError on missing or bad fields."""
    family = config.get("model_type")
    if family not in BUILDERS:
        raise ConfigError(f"no analytic builder for model_type {quote(family)}")
    c = _Cfg(config, family)
    e = _Emitter(config_dtype(config))
    BUILDERS[family](c, e)
    return ParamInventory(model_name=model_name, source=source, builder="analytic", family=family,
                          tensors=tuple(e.tensors), dims=model_dims(config), buffers=tuple(e.buffers))
