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
