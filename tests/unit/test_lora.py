"""LoRA: the adapters and frozen parameters memplan puts in the inventory are PEFT's, tensor by tensor, and the
engine gives gradients, reduce buffers and optimizer states to the trainable parameters only."""

import json
from dataclasses import replace

import pytest

from memplan import accounting, options
from memplan.errors import MemplanError, SettingsError
from memplan.model import lora, sources
from memplan.model.scaling import scale_config

TINY = {"llama-3-8b": dict(layers=2, hidden=256, vocab=512), "gpt2": dict(layers=2, hidden=64, vocab=256),
        "mixtral-8x7b": dict(layers=2, hidden=128, vocab=256), "qwen2.5-7b": dict(layers=2, hidden=128, vocab=256)}


def _tiny(name):
    cfg, _ = scale_config(sources.resolve(name).config, **TINY[name])
    src = replace(sources.resolve(name), config=cfg, checkpoint=())
    return cfg, sources.build_inventory(src)


# PEFT prints "trainable params: ..." for these; memplan's count must be the same
@pytest.mark.parametrize("targets,count", [(("q_proj", "v_proj"), 6_815_744), ("all-linear", 41_943_040)])
def test_trainable_counts_llama3_8b(inventories, targets, count):
    inv = lora.apply(inventories("llama-3-8b"), lora.LoraSpec(rank=16, targets=targets))
    assert inv.trainable_params == count
    assert inv.num_params == inventories("llama-3-8b").num_params + count


SPECS = [
    ("llama-3-8b", lora.LoraSpec(rank=8)),  # PEFT's default targets for llama: q_proj, v_proj
    ("llama-3-8b", lora.LoraSpec(rank=4, targets="all-linear", modules_to_save=("lm_head",))),
    ("llama-3-8b", lora.LoraSpec(rank=4, targets=r".*\.mlp\.(up|down)_proj", bias="all")),
    ("llama-3-8b", lora.LoraSpec(rank=4, targets=("q_proj", "o_proj"), layers_to_transform=(1,),
                                 rank_pattern=(("o_proj", 2),))),
    ("gpt2", lora.LoraSpec(rank=4, targets="all-linear", bias="lora_only")),  # Conv1D: weight [in, out]
    ("mixtral-8x7b", lora.LoraSpec(rank=4, targets=("q_proj", "k_proj", "v_proj", "o_proj"))),
    ("qwen2.5-7b", lora.LoraSpec(rank=4, targets=("q_proj", "k_proj"), exclude_modules=("model.layers.0.self_attn.k_proj",))),
]


@pytest.mark.parametrize("name,spec", SPECS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SPECS)])
def test_inventory_equals_peft(name, spec):
    """Every parameter PEFT's get_peft_model leaves, with its shape and requires_grad, in module order."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from memplan.model.meta_builder import hf_config

    cfg, inv = _tiny(name)
    ours = lora.apply(inv, spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg))
    f = spec.trace_fields()
    pc = peft.LoraConfig(r=spec.rank, target_modules=(f["targets"] or None), bias=spec.bias,
                         modules_to_save=list(spec.modules_to_save) or None,
                         layers_to_transform=list(spec.layers_to_transform) or None,
                         exclude_modules=list(spec.exclude_modules) or None, rank_pattern=dict(spec.rank_pattern))
    pm = peft.get_peft_model(model, pc)
    theirs = [(n.removeprefix("base_model.model."), tuple(p.shape), p.requires_grad)
              for n, p in pm.named_parameters()]
    mine = [(t.name, t.shape, t.trainable) for t in ours.tensors]
    assert sorted(mine) == sorted(theirs)
    assert [n for n, _, _ in mine if ".lora_" in n] == [n for n, _, _ in theirs if ".lora_" in n]


def _settings(inv, spec, strategy, gpus, **kw):
    return options.resolve(inv, gpus=gpus, strategy=strategy, lora=spec, activations="analytic", **kw).settings


@pytest.mark.parametrize("strategy,gpus", [("single", 1), ("ddp", 4), ("fsdp-full", 4), ("zero2", 4),
                                           ("zero3", 4), ("zero-optimizer", 4), ("hsdp", 16)])
def test_model_states_follow_the_trainable_parameters(inventories, strategy, gpus):
    base = inventories("llama-3-8b")
    spec = lora.LoraSpec(rank=16, targets="all-linear")
    inv = lora.apply(base, spec)
    s = _settings(inv, spec, strategy, gpus)
    p = accounting.estimate(inv, s)
    rc, n = s.recipe, accounting.shard_group_size(s)
    trainable = [t for t in inv.tensors if t.trainable]
    if strategy in ("single", "ddp", "zero-optimizer"):
        assert p.peak.weights_bytes == rc.param_bytes * inv.num_params
    if strategy in ("single", "ddp"):
        assert p.peak.optimizer_states_bytes == 2 * rc.state_bytes * inv.trainable_params
    if strategy in ("fsdp-full", "hsdp"):
        dim0 = sum(-(-t.shape[0] // n) * (t.numel // t.shape[0]) for t in trainable)
        assert p.peak.optimizer_states_bytes == 2 * 4 * dim0
        assert p.peak.weights_bytes == 4 * sum(-(-t.shape[0] // n) * (t.numel // t.shape[0]) for t in inv.tensors)
    if strategy == "zero2":
        # DeepSpeed flattens the trainable parameters only; the frozen ones stay whole bf16 module parameters
        flat = -(-inv.trainable_params // (2 * n)) * 2 * n
        assert p.peak.weights_bytes == 2 * (flat + inv.num_params - inv.trainable_params)
        assert p.peak.optimizer_states_bytes == 2 * 4 * (flat // n)
        assert p.peak.master_weights_bytes == 4 * (flat // n)
    if strategy == "zero3":
        assert p.peak.optimizer_states_bytes == 2 * 4 * sum(-(-t.numel // n) for t in trainable)
    # far below full fine-tuning's states, and gradients for the adapters only
    full = accounting.estimate(base, options.resolve(base, gpus=gpus, strategy=strategy,
                                                      activations="analytic").settings)
    assert p.peak.optimizer_states_bytes * 50 < full.peak.optimizer_states_bytes
    assert max(ph.grads_bytes for ph in p.phases) <= rc.grad_bytes * inv.trainable_params
    assert p.peak.total_bytes < full.peak.total_bytes


def test_nothing_frozen_changes_nothing(inventories):
    inv = inventories("llama-3-8b")
    assert inv.trainable_inventory is inv and not inv.frozen
    assert inv.trainable_params == inv.num_params


def test_fsdp1_with_frozen_parameters_is_refused(inventories):
    spec = lora.LoraSpec(rank=8)
    inv = lora.apply(inventories("llama-3-8b"), spec)
    with pytest.raises(SettingsError, match="FSDP1"):
        options.resolve(inv, gpus=8, strategy="fsdp-full", lora=spec, activations="analytic",
                        torch_overrides={"fsdp_version": 1})


def test_communication_reduces_the_adapters_and_gathers_everything(inventories):
    from memplan.comm import communication

    spec = lora.LoraSpec(rank=16)
    inv = lora.apply(inventories("llama-3-8b"), spec)
    s = _settings(inv, spec, "fsdp-full", 8)
    ops = {c["what"]: c for c in communication(inv, s)["collectives"] if c["op"] in ("all-gather", "reduce-scatter")}
    rs, ag = ops["gradients"], ops["parameters, forward"]
    assert rs["bytes_per_gpu"] < ag["bytes_per_gpu"] / 100


@pytest.mark.parametrize("bad,match", [
    (lora.LoraSpec(rank=8, targets=("nope",)), "match no linear layer"),
    (lora.LoraSpec(rank=8, targets=("embed_tokens",)), "an embedding"),
    (lora.LoraSpec(rank=8, targets="(unclosed"), "not a regular expression"),
])
def test_targets_peft_would_reject(inventories, bad, match):
    with pytest.raises(SettingsError, match=match):
        lora.apply(inventories("llama-3-8b"), bad)


@pytest.mark.parametrize("targets", ["all-linear", ("q_proj", "w1"), r".*proj"])
def test_fused_moe_expert_targets_are_refused(inventories, targets):
    """PEFT turns these into LoRA on the fused 3-D expert parameters (ParamWrapper), which memplan does not model."""
    with pytest.raises(SettingsError, match="fused experts"):
        lora.apply(inventories("mixtral-8x7b"), lora.LoraSpec(rank=8, targets=targets))


def test_no_default_targets_for_an_unknown_type(inventories):
    inv = replace(inventories("llama-3-8b"), family="custom")
    with pytest.raises(SettingsError, match="no default LoRA targets"):
        lora.apply(inv, lora.LoraSpec(rank=8))


def test_adapter_config(tmp_path, inventories):
    p = tmp_path / "adapter_config.json"
    p.write_text(json.dumps({"peft_type": "LORA", "r": 32, "lora_alpha": 64, "lora_dropout": 0.05,
                             "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "bias": "none",
                             "task_type": "CAUSAL_LM", "use_rslora": False, "something_new": 1}))
    spec = lora.read_adapter_config(str(tmp_path))
    assert (spec.rank, spec.dropout, spec.targets) == (32, 0.05, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert any("something_new" in n for n in spec.notes)
    inv = lora.apply(inventories("llama-3-8b"), spec)
    assert inv.trainable_params == 32 * 32 * (2 * 4096 + 2 * (4096 + 1024) + 2 * 4096)


@pytest.mark.parametrize("content,match", [
    ('{"peft_type": "LORA", "use_dora": true, "r": 8}', "DoRA"),
    ('{"peft_type": "IA3"}', "IA3 is not modelled"),
    ('{"peft_type": "LORA", "r": "eight"}', "r must be a number"),
    ('{"peft_type": "LORA", "r": 0}', "at least 1"),
    ('{"peft_type": "LORA", "target_modules": 3}', "target_modules"),
    ('{"peft_type": "LORA", ', "line 1"),
])
def test_bad_adapter_configs(tmp_path, content, match):
    p = tmp_path / "adapter_config.json"
    p.write_text(content)
    with pytest.raises(MemplanError, match=match):
        lora.read_adapter_config(str(p))


def test_traced_lora_step_saves_less_than_full_training():
    """The traced step with PEFT's LoRA forward: frozen linears keep no inputs for weight gradients, so less is
    alive after forward than in full fine-tuning; the adapters' gradients are the only ones."""
    from memplan.tracing import trace_profile

    cfg, inv = _tiny("llama-3-8b")
    spec = lora.LoraSpec(rank=8, targets="all-linear")
    full = trace_profile(cfg, seq_len=64, recipe="deepspeed-bf16", attention="flash", recompute="none", device="cpu")
    ad = trace_profile({**cfg, "lora": spec.trace_fields()}, seq_len=64, recipe="deepspeed-bf16",
                       attention="flash", recompute="none", device="cpu")
    a, f = ad["saved_for_backward"], full["saved_for_backward"]
    assert 0 < a[0] + a[1] < f[0] + f[1]
    assert 0 < sum(ad["live_after_forward"]) < sum(full["live_after_forward"])


@pytest.mark.parametrize("recipe,cast", [("fsdp-bf16", True), ("fp32", False), ("pure-bf16", False)])
def test_fsdp2_backward_prefetch_holds_the_cast_copy_in(inventories, recipe, cast):
    # The last block's pre-backward copies itself out, then all-gathers the block before it: the all-gather
    # output and, where the MixedPrecisionPolicy casts (param_dtype unlike the stored dtype), the flat
    # param_dtype copy of the shard (_fsdp_collectives.py _get_param_all_gather_inputs). With frozen embeddings
    # (LoRA, no recompute) this moment is the peak: measured -1.40% (q,v) and -3.13% (all-linear) without it.
    from memplan import layouts
    from memplan.timeline import Moment

    spec = lora.LoraSpec(rank=16, targets="all-linear")
    inv = lora.apply(inventories("llama-3-8b"), spec)
    s = options.resolve(inv, gpus=8, strategy="fsdp-full", precision=recipe, lora=spec,
                        activations="analytic").settings
    tl = accounting.timeline(inv, s)
    g = layouts.gather_sizes(inv, s.strategy.layout, 8)
    cb = s.recipe.grad_bytes
    last, prev = g.block_numels[-1], g.block_numels[-2]
    assert last == prev
    # the copy-out (all-gather output and the copies: two blocks) and then the prefetch (the block copied out,
    # the next one's output, and its cast copy-in: 1/8 of a block)
    begins = sorted(m.buffers for m in tl.moments if m.at == Moment.LAST_BLOCK_BACKWARD_BEGINS)
    assert len(begins) == 2
    assert begins[1] - begins[0] == (cb * prev // 8 if cast else 0)
