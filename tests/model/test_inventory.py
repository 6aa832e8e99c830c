"""The analytic inventory equals the meta-device one tensor by tensor, and totals match the anchors exactly."""

import json
from dataclasses import replace

import pytest

from memplan.model import families, sources
from memplan.model.inventory import ROOT_BLOCK, classify

# ../shared/reference/anchors.md: transformers 5.23 on the meta device, tied weights once.
ANCHORS = {
    "gpt2": 124_439_808,
    "llama-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
}


def _key(inv):
    return [(t.name, t.shape, t.block, t.tied_names, t.category, t.layer) for t in inv.tensors] + \
        [("buffer", t.name, t.shape, t.dtype, t.block) for t in inv.buffers]


@pytest.mark.parametrize("name,count", sorted(ANCHORS.items()))
def test_anchor_counts_exact(inventories, name, count):
    assert inventories(name).num_params == count
    assert inventories(name).builder == "analytic"


@pytest.mark.parametrize("name", sources.preset_names())
def test_analytic_equals_meta_for_every_preset(inventories, name):
    a, m = inventories(name, "analytic"), inventories(name, "meta")
    assert _key(a) == _key(m)
    assert a.num_params == m.num_params


VARIANTS = {
    "gemma": {"model_type": "gemma", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 100},
    "gemma2": {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100},
    "neox": {"model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "vocab_size": 100},
    "neox-tied-nobias": {"model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 256,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
                         "tie_word_embeddings": True, "attention_bias": False},
    "phi3-partial-rotary": {"model_type": "phi3", "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "partial_rotary_factor": 0.5},
    "neox-rotary-half": {"model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 256,
                         "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 100, "rotary_pct": 0.5},
    "falcon-alibi": {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4, "alibi": True,
                     "num_hidden_layers": 2, "vocab_size": 100},
    "llama3-rope": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "vocab_size": 100,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "phi3": {"model_type": "phi3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2},
    "falcon-7b-defaults": {"model_type": "falcon", "num_hidden_layers": 2},
    "falcon-new-arch": {"model_type": "falcon", "hidden_size": 256, "num_attention_heads": 8, "num_kv_heads": 2,
                        "new_decoder_architecture": True, "num_hidden_layers": 2, "vocab_size": 100},
    "falcon-sequential": {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4, "multi_query": False,
                          "parallel_attn": False, "bias": True, "num_hidden_layers": 2, "vocab_size": 100,
                          "tie_word_embeddings": False},
    "falcon-one-ln": {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
                      "new_decoder_architecture": True, "num_ln_in_parallel_attn": 1, "num_hidden_layers": 2,
                      "vocab_size": 100, "ffn_hidden_size": 100},
    "qwen2-moe": {"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "num_experts": 4,
                  "num_hidden_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100},
    "qwen3": {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 100,
              "attention_bias": True, "tie_word_embeddings": True},
    "qwen3-moe": {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
                  "moe_intermediate_size": 32, "num_experts": 4, "num_hidden_layers": 3, "mlp_only_layers": [1],
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100},
    "llama-bias-tied": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "vocab_size": 100, "attention_bias": True, "mlp_bias": True,
                        "head_dim": 8, "tie_word_embeddings": True},
    "mistral-head-dim": {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "head_dim": 32, "vocab_size": 100, "attention_bias": True},
    "qwen2-tied": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
                   "tie_word_embeddings": True},
    "deepseek-v3-no-q-lora": {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128,
                              "moe_intermediate_size": 16, "n_routed_experts": 4, "n_shared_experts": 2,
                              "first_k_dense_replace": 1, "num_hidden_layers": 3, "num_attention_heads": 4,
                              "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                              "qk_rope_head_dim": 4, "v_head_dim": 8, "vocab_size": 100, "n_group": 2,
                              "topk_group": 1, "num_experts_per_tok": 2, "attention_bias": True},
    "gpt2-untied": {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_inner": 100,
                    "vocab_size": 100, "tie_word_embeddings": False, "n_positions": 32, "bos_token_id": 0,
                    "eos_token_id": 0},
    "mixtral": {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "num_local_experts": 3,
                "num_experts_per_tok": 2, "head_dim": 32},
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_analytic_equals_meta_on_family_variants(name):
    from memplan.model.meta_builder import build_meta_from_config

    cfg = VARIANTS[name]
    a = families.build_analytic(cfg, name, "test")
    m = build_meta_from_config(cfg, name, "test")
    assert _key(a) == _key(m)


@pytest.mark.parametrize("family", sorted(families.FAMILY_DEFAULTS))
def test_family_defaults_match_transformers(family):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(family)
    for key, value in families.FAMILY_DEFAULTS[family].items():
        if value is None:  # resolved later from another field (e.g. num_key_value_heads <- heads)
            continue
        assert getattr(cfg, key) == value, key


def test_tied_weights_counted_once(inventories):
    inv = inventories("gpt2")
    tied = dict(inv.tied)
    assert tied == {"transformer.wte.weight": ("lm_head.weight",)}
    assert not any(t.name == "lm_head.weight" for t in inv.tensors)


def test_blocks_and_largest(inventories):
    inv = inventories("llama-7b")
    assert len(inv.layer_blocks) == 32
    assert inv.largest_layer_block.numel == 202_383_360  # 4*4096^2 + 3*4096*11008 + 2*4096
    assert inv.largest_tensor.name == "model.embed_tokens.weight"
    root = [t.name for t in inv.tensors if t.block == ROOT_BLOCK]
    assert root == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


def test_mixtral_expert_tensors_are_3d(inventories):
    inv = inventories("mixtral-8x7b")
    t = next(t for t in inv.tensors if t.name.endswith("layers.0.mlp.experts.gate_up_proj"))
    assert t.shape == (8, 28672, 4096) and t.category == "experts"
    assert inv.numel_by_category["router"] == 32 * 8 * 4096


@pytest.mark.parametrize("name,category", [
    ("model.layers.0.self_attn.q_proj.weight", "attention"), ("model.layers.0.mlp.up_proj.weight", "mlp"),
    ("model.layers.0.input_layernorm.weight", "norm"), ("transformer.h.0.ln_1.bias", "norm"),
    ("lm_head.weight", "head"), ("transformer.wpe.weight", "embedding"),
    ("model.layers.1.mlp.gate.weight", "router"), ("model.layers.1.mlp.experts.down_proj", "experts"),
    ("model.layers.1.mlp.shared_experts.up_proj.weight", "mlp"),
    ("model.layers.0.self_attn.q_a_layernorm.weight", "norm"),
])
def test_classify(name, category):
    assert classify(name) == category


def test_unknown_family_falls_back_to_meta(tmp_path):
    cfg = {"model_type": "olmo", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 100, "pad_token_id": 1, "eos_token_id": 0}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    inv = sources.build_inventory(sources.resolve(str(p)))
    assert inv.builder == "meta"
    assert any("no analytic builder" in n for n in inv.notes)
    assert inv.num_params > 0 and len(inv.layer_blocks) == 2


def test_buffers_are_the_models_own_and_whole_on_every_rank():
    """named_buffers, persistent or not: M2M100's two sinusoidal tables [max_positions + 2, d_model] (non-persistent
    fp32 buffers) are on every rank, in 16 bits only where the model itself is converted (not under DeepSpeed's
    parameter cast), and counted with the weights; the harness measured them (docs/accuracy.md, m2m100 rows:
    -2.67% before, -0.00% with them)."""
    from memplan import accounting, options
    from memplan.request import JobRequest

    src = sources.resolve("tests/data/configs/m2m100.json")
    inv = sources.build_inventory(src)
    assert [(t.name, t.shape, t.dtype) for t in inv.buffers] == [
        ("model.encoder.embed_positions.weights", (1026, 1024), "float32"),
        ("model.decoder.embed_positions.weights", (1026, 1024), "float32")]
    table = 1026 * 1024
    assert inv.buffer_bytes(False) == 2 * 4 * table and inv.buffer_bytes(True) == 2 * 2 * table
    # the rule on a decoder (analytic activations), its buffers the rotary inv_freq and original_inv_freq
    llama = sources.build_inventory(sources.resolve("llama-3-8b"))
    assert [(t.name, t.shape) for t in llama.buffers] == [("model.rotary_emb.inv_freq", (64,)),
                                                          ("model.rotary_emb.original_inv_freq", (64,))]
    for strategy, precision, gpus in (("single", "fp32", 1), ("fsdp-full", "fsdp-bf16", 4),
                                      ("zero3", "deepspeed-bf16", 4), ("ddp", "pure-bf16", 2)):
        s = options.resolve(llama, JobRequest.of(gpus=gpus, strategy=strategy, precision=precision,
                                                 activations="analytic")).settings
        half = precision == "pure-bf16"
        assert s.recipe.half_buffers == half
        with_them = accounting.estimate(llama, s).peak.weights_bytes
        assert with_them - accounting.estimate(replace(llama, buffers=()), s).peak.weights_bytes == \
            2 * 512  # not sharded: every rank holds them whole, each in a 512-byte CUDA block


def test_a_parameter_built_without_requires_grad_is_not_trained():
    """RoFormer's sinusoidal positions are nn.Embedding(_freeze=True): a parameter with requires_grad=False, which
    gets no gradient and no optimizer state (the CPU harness: RoFormer's states +786,432 B over before)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoConfig, RoFormerForCausalLM

    from memplan.model.meta_builder import build_meta_from_config

    cfg = {"model_type": "roformer", "architectures": ["RoFormerForCausalLM"], "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 512,
           "max_position_embeddings": 256, "embedding_size": 64, "is_decoder": True}
    inv = build_meta_from_config(cfg, "roformer", "test")
    with torch.device("meta"):
        model = RoFormerForCausalLM(AutoConfig.for_model(**cfg))
    assert inv.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert [t.name for t in inv.tensors if not t.trainable] == ["roformer.encoder.embed_positions.weight"]
    assert inv.num_params - inv.trainable_params == 256 * 32
    assert any("built with requires_grad=False" in n for n in inv.notes)
