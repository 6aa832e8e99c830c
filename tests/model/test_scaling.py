"""A smaller config of the same architecture (memplan/model/scaling.py): what validate runs and the tracer traces."""

from __future__ import annotations

from memplan.model.scaling import layer_index_keys, per_layer_keys, scale_config


def test_lists_with_an_entry_per_layer_keep_the_layers_kept():
    """transformers' configs check each per-layer list's length against num_hidden_layers (layer_types,
    mlp_layer_types, num_attention_heads_per_layer): scaled with it. Other lists (a rope section) stay."""
    cfg = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
           "layer_types": ["sliding_attention", "full_attention"] * 2, "mlp_layer_types": ["dense", "sparse",
                                                                                        "sparse", "sparse"],
           "num_attention_heads_per_layer": [4, 4, 8, 8], "mrope_section": [1, 2, 3, 4],
           "per_layer_config": {"01": {"head_dim": 128}, "3": {"head_dim": 128}}}
    assert sorted(per_layer_keys(cfg, 4)) == ["layer_types", "mlp_layer_types", "num_attention_heads_per_layer"]
    assert layer_index_keys(cfg) == ["per_layer_config"]
    small, changes = scale_config(cfg, layers=2)
    assert changes == ["num_hidden_layers 4 -> 2"]
    assert small["layer_types"] == ["sliding_attention", "full_attention"]
    assert small["mlp_layer_types"] == ["dense", "sparse"]
    assert small["num_attention_heads_per_layer"] == [4, 4]
    assert small["mrope_section"] == [1, 2, 3, 4]
    assert small["per_layer_config"] == {"01": {"head_dim": 128}}
    assert cfg["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]  # the caller's config untouched


def test_blocks_that_differ_by_a_per_layer_list_are_traced_at_full_depth():
    """A per-layer list whose entries differ (dense then sparse MLPs) makes the blocks differ: the trace runs every
    block instead of scaling to one and two."""
    from memplan.activations.tracing.fit import traced_steps

    base = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4}
    assert traced_steps(base) == 4
    assert traced_steps({**base, "mlp_layer_types": ["dense"] * 4}) == 4
    assert traced_steps({**base, "mlp_layer_types": ["dense"] + ["sparse"] * 3}) == 2
    assert traced_steps({**base, "per_layer_config": {"3": {"head_dim": 128}}}) == 2


def test_block_and_head_counts_under_each_family_s_names():
    """MPT names them n_layers and n_heads; BartForCausalLM (an encoder-decoder family's decoder alone) its
    decoder's decoder_layers and decoder_attention_heads: the trace's depth, the scaler and the dimensions read
    them (the trace failed with "no layer count", and validate with "no layer count to scale")."""
    from memplan.activations.tracing.fit import traced_steps
    from memplan.model.config import model_dims

    mpt = {"model_type": "mpt", "d_model": 2048, "n_heads": 16, "n_layers": 24, "vocab_size": 50368}
    assert {k: model_dims(mpt)[k] for k in ("hidden_size", "num_layers", "num_heads")} == \
        {"hidden_size": 2048, "num_layers": 24, "num_heads": 16}
    assert traced_steps(mpt) == 4
    small, _ = scale_config(mpt, layers=2, hidden=256)
    assert (small["n_layers"], small["d_model"], small["n_heads"]) == (2, 256, 2)
    bart = {"model_type": "bart", "architectures": ["BartForCausalLM"], "d_model": 1024, "decoder_layers": 12,
            "encoder_layers": 12, "decoder_attention_heads": 16, "decoder_ffn_dim": 4096, "num_hidden_layers": None}
    assert {k: model_dims(bart)[k] for k in ("num_layers", "num_heads", "intermediate_size")} == \
        {"num_layers": 12, "num_heads": 16, "intermediate_size": 4096}
    assert traced_steps(bart) == 4


def test_a_depth_given_by_per_layer_lists_alone():
    """Nemotron-H's config class derives num_hidden_layers from layers_block_type (a property its to_dict leaves
    out): the depth is that list's length, and --layers scales the list."""
    from memplan.activations.tracing.fit import traced_steps
    from memplan.model.config import layer_count, model_dims

    cfg = {"model_type": "nemotron_h", "hidden_size": 256, "num_attention_heads": 4,
           "layers_block_type": ["mamba", "moe", "attention", "mlp"]}
    assert layer_count(cfg) == 4 and model_dims(cfg)["num_layers"] == 4
    assert traced_steps(cfg) == 2  # the blocks differ: traced at full depth
    small, changes = scale_config(cfg, layers=2)
    assert small["layers_block_type"] == ["mamba", "moe"] and changes == ["layers 4 -> 2"]
    assert layer_count({"hybrid_override_pattern": "M-M*"}) == 4 and layer_count({}) is None


def test_lists_of_layer_indices_keep_the_indices_of_the_layers_kept():
    """Mllama's cross_attention_layers and Llama 4's moe_layers name layers by index (`layer_idx in
    config.cross_attention_layers`): scaled, they keep the indices below the new depth; naming some layers but not
    all, they make the blocks differ (traced at full depth), as Llama 4's interleave_moe_layer_step does where the
    config lists no moe_layers."""
    from memplan.activations.tracing.fit import traced_steps
    from memplan.model.scaling import index_list_keys

    cfg = {"num_hidden_layers": 10, "hidden_size": 256, "num_attention_heads": 4,
           "cross_attention_layers": [3, 8], "moe_layers": list(range(10)), "no_rope_layers": [1, 1, 1, 0] * 2 + [1, 1]}
    assert sorted(index_list_keys(cfg, 10)) == ["cross_attention_layers", "moe_layers"]
    assert per_layer_keys(cfg, 10) == ["no_rope_layers"]
    small, _ = scale_config(cfg, layers=5)
    assert small["cross_attention_layers"] == [3] and small["moe_layers"] == [0, 1, 2, 3, 4]
    assert small["no_rope_layers"] == [1, 1, 1, 0, 1]
    # traced_steps: 4 (two depths) where the blocks are alike, 2 (the full depth) where they differ
    plain = {"num_hidden_layers": 10, "moe_layers": list(range(10))}
    assert traced_steps(plain) == 4
    assert traced_steps({**plain, "moe_layers": [1, 3, 5, 7, 9]}) == 2
    assert traced_steps({"num_hidden_layers": 10, "interleave_moe_layer_step": 2}) == 2
    assert traced_steps({"num_hidden_layers": 10, "interleave_moe_layer_step": 1}) == 4


def test_distilbert_and_xlm_widths_scale_under_their_own_names():
    """DistilBERT names its width dim, its heads n_heads and its MLP hidden_dim; XLM and FlauBERT emb_dim: --hidden
    scales them as hidden_size, and the MLP in proportion (the CPU harness: DistilBertForMaskedLM -0.00%)."""
    cfg = {"model_type": "distilbert", "dim": 768, "n_heads": 12, "n_layers": 6, "hidden_dim": 3072,
           "vocab_size": 30522}
    out, _ = scale_config(cfg, layers=2, hidden=256, vocab=2048)
    assert (out["dim"], out["n_heads"], out["hidden_dim"], out["n_layers"]) == (256, 4, 1024, 2)
    xlm, _ = scale_config({"model_type": "xlm", "emb_dim": 2048, "n_heads": 16, "n_layers": 12}, hidden=512)
    assert (xlm["emb_dim"], xlm["n_heads"]) == (512, 4)


def test_layoutlmv3_s_spatial_widths_still_add_up_to_the_hidden_size():
    """LayoutLMv3 concatenates 4 coordinate and 2 shape embeddings into the hidden states: scaled, they still add
    up to it (CPU harness, LayoutLMv3ForTokenClassification at hidden 256: -0.01%)."""
    cfg = {"model_type": "layoutlmv3", "hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12,
           "coordinate_size": 128, "shape_size": 128}
    out, _ = scale_config(cfg, hidden=256)
    assert 4 * out["coordinate_size"] + 2 * out["shape_size"] == 256
