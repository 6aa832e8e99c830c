"""DeepSpeed ZeRO-3 leaf modules (memplan/model/z3_leaf.py): which modules DeepSpeed 0.19.8 fetches whole, and the
coordinator replay grouping their parameters into one fetch."""

import json
from dataclasses import replace

import pytest

from memplan import accounting, dsconfig, options
from memplan.errors import SettingsError
from memplan.frameworks.zero3 import zero3_schedule
from memplan.model import sources, z3_leaf
from memplan.model.inventory import ParamInventory, ParamTensor
from memplan.model.scaling import scale_config
from memplan.request import JobRequest


def test_default_classes_are_the_sparse_moe_blocks(inventories):
    # runtime/zero/leaf_module_config.py DEFAULT_LEAF_MODULE_CLASSES, applied by the engine to every model
    mix = inventories("mixtral-8x7b")
    leaves = z3_leaf.resolve(mix, None, (), (), 0, None)
    assert len(leaves) == 32 and "model.layers.0.mlp" in leaves
    assert z3_leaf.resolve(inventories("llama-3-8b"), None, (), (), 0, None) == ()
    # DeepSeek-V3's MoE block is not among DeepSpeed's default classes
    assert z3_leaf.resolve(inventories("deepseek-v3"), None, (), (), 0, None) == ()
    # an empty class list (leaf_module.classes: [] or --z3-leaf-modules none) turns them off
    assert z3_leaf.resolve(mix, (), (), (), 0, None) == ()


def test_names_and_suffixes(inventories):
    inv = inventories("llama-3-8b")
    assert z3_leaf.resolve(inv, (), ("model.layers.3.mlp",), (), 0, None) == ("model.layers.3.mlp",)
    got = z3_leaf.resolve(inv, (), (), ("self_attn",), 0, None)
    assert len(got) == 32 and all(p.endswith("self_attn") for p in got)
    with pytest.raises(SettingsError, match="not in"):
        z3_leaf.resolve(inv, (), ("model.layers.99.mlp",), (), 0, None)


def test_granularity_threshold_as_deepspeed_computes_it():
    # parameter_offload.py _get_granularity_recursively: gpt2's attention (c_attn + c_proj, 2 torch leaves + itself)
    # has (3h*h + 3h + h*h + h) / 3 parameters per layer; at that threshold every block's attention becomes a leaf
    cfg, _ = scale_config(sources.resolve("gpt2").config, layers=2, hidden=64, vocab=256)
    src = replace(sources.resolve("gpt2"), config=cfg, checkpoint=())
    inv = sources.build_inventory(src)
    h = 64
    attn = (3 * h * h + 3 * h + h * h + h) // 3
    leaves = z3_leaf.resolve(inv, (), (), (), attn, cfg)
    assert "transformer.h.0.attn" in leaves and "transformer.h.1.attn" in leaves
    # the MLP (c_fc + c_proj: (8h^2 + 5h) / 3) and the block are coarser: not leaves
    assert not any(p.startswith(("transformer.h.0.mlp", "transformer.h.1.mlp")) for p in leaves)
    assert "transformer.h.0" not in leaves


def test_a_leaf_is_fetched_as_one_module():
    t = (ParamTensor("layers.0.mlp.gate.weight", (8, 64), "bfloat16", "layers.0", "router"),
         ParamTensor("layers.0.mlp.experts.w", (8, 64, 256), "bfloat16", "layers.0", "experts"),
         ParamTensor("layers.0.attn.w", (64, 64), "bfloat16", "layers.0", "attention"))
    inv = ParamInventory(model_name="toy", source="test", builder="test", family="mixtral", tensors=t,
                         dims={"hidden_size": 64, "num_layers": 1})
    # no prefetch, no reuse: each module gathers its own and releases it after running
    per_module = zero3_schedule(inv, 2, 0, 10**9, 0, 0)
    leaf = zero3_schedule(inv, 2, 0, 10**9, 0, 0, None, ("layers.0.mlp",))
    gate, experts = 8 * 64, 8 * 64 * 256
    # per module: the experts alone at most; as a leaf: the router and the experts together, plus the coalesced
    # gather's flat buffer beside their copies
    assert per_module.forward == experts
    assert leaf.forward == 2 * (gate + experts)


def test_ds_config_leaf_module_and_threshold(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 1000,
                                                   "leaf_module": {"classes": ["LlamaMLP"], "names": "lm_head"}}}))
    d = dsconfig.load(str(p))
    assert d.knobs["leaf_classes"] == ("LlamaMLP",) and d.knobs["leaf_names"] == ("lm_head",)
    assert d.knobs["module_granularity_threshold"] == 1000 and not d.notes


def test_estimate_takes_deepspeeds_default_leaves(inventories):
    inv = inventories("mixtral-8x7b")
    r = options.resolve(inv, JobRequest.of(gpus=8, stage=3, activations="analytic"))
    assert len(r.settings.z3_leaves) == 32 and any("leaf modules" in n for n in r.notes)
    off = options.resolve(inv, JobRequest.of(gpus=8, stage=3, activations="analytic", leaf_classes=()))
    assert off.settings.z3_leaves == ()
    assert accounting.estimate(inv, r.settings).peak_bytes != accounting.estimate(inv, off.settings).peak_bytes
