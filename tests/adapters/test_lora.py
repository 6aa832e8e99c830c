"""LoRA: the adapters and frozen parameters memplan puts in the inventory are PEFT's, tensor by tensor, and the
engine gives gradients, reduce buffers and optimizer states to the trainable parameters only."""

import json
from dataclasses import replace

import pytest

from memplan import accounting, options
from memplan.errors import ConfigError, MemplanError, SettingsError
from memplan.model import lora, sources
from memplan.model.scaling import scale_config
from memplan.request import JobRequest

TINY = {"llama-3-8b": dict(layers=2, hidden=256, vocab=512), "gpt2": dict(layers=2, hidden=64, vocab=256),
        "deepseek-v3": dict(layers=4, hidden=128, vocab=256),
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
    # transformers 5 fuses the experts: PEFT's conversion moves the expert and router targets onto the fused
    # parameters (lora.ParamWrapper, gate_up_proj at twice the rank), and a pattern becomes the leaf names it hits
    ("mixtral-8x7b", lora.LoraSpec(rank=4, targets="all-linear")),
    ("mixtral-8x7b", lora.LoraSpec(rank=4, targets=("q_proj", "w1", "w3", "w2"))),
    ("mixtral-8x7b", lora.LoraSpec(rank=4, targets=r".*layers\.0\.self_attn\.q_proj")),
    ("mixtral-8x7b", lora.LoraSpec(rank=4, targets=r".*\.experts\.w2")),
    ("mixtral-8x7b", lora.LoraSpec(rank=4, targets=("v_proj",), target_parameters=("experts.down_proj",))),
    ("llama-3-8b", lora.LoraSpec(rank=4, targets=(), target_parameters=("mlp.down_proj.weight",))),
    # the dense layers' and shared experts' gate/up/down_proj lose their adapters to the conversion
    ("deepseek-v3", lora.LoraSpec(rank=4, targets=("q_a_proj", "gate_proj", "up_proj", "down_proj"))),
    ("deepseek-v3", lora.LoraSpec(rank=4, targets="all-linear")),
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
                         target_parameters=list(spec.target_parameters) or None,
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
    return options.resolve(inv, JobRequest.of(gpus=gpus, strategy=strategy, lora=spec, activations="analytic", **kw)).settings


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
    buffers = inv.buffer_bytes(rc.half_buffers, 512)  # the model's buffers (rotary inv_freq), whole on every rank
    if strategy in ("single", "ddp", "zero-optimizer"):
        assert p.peak.weights_bytes == rc.param_bytes * inv.num_params + buffers
    if strategy in ("single", "ddp"):
        assert p.peak.optimizer_states_bytes == 2 * rc.state_bytes * inv.trainable_params
    if strategy in ("fsdp-full", "hsdp"):
        dim0 = sum(-(-t.shape[0] // n) * (t.numel // t.shape[0]) for t in trainable)
        assert p.peak.optimizer_states_bytes == 2 * 4 * dim0
        assert p.peak.weights_bytes == 4 * sum(-(-t.shape[0] // n) * (t.numel // t.shape[0]) for t in inv.tensors) \
            + buffers
    if strategy == "zero2":
        # DeepSpeed flattens the trainable parameters only; the frozen ones stay whole bf16 module parameters
        flat = -(-inv.trainable_params // (2 * n)) * 2 * n
        assert p.peak.weights_bytes == 2 * (flat + inv.num_params - inv.trainable_params) + buffers
        assert p.peak.optimizer_states_bytes == 2 * 4 * (flat // n)
        assert p.peak.master_weights_bytes == 4 * (flat // n)
    if strategy == "zero3":
        assert p.peak.optimizer_states_bytes == 2 * 4 * sum(-(-t.numel // n) for t in trainable)
    # far below full fine-tuning's states, and gradients for the adapters only
    full = accounting.estimate(base, options.resolve(base, JobRequest.of(gpus=gpus, strategy=strategy, activations="analytic")).settings)
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
        options.resolve(inv, JobRequest.of(gpus=8, strategy="fsdp-full", lora=spec, activations="analytic", fsdp_version=1))


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


@pytest.mark.parametrize("spec,match", [
    (lora.LoraSpec(rank=8, targets=("q_proj", "w1")), "without also w3"),  # fused into gate_up_proj
    (lora.LoraSpec(rank=8), "no default LoRA targets for mixtral"),  # the conversion empties target_modules
    (lora.LoraSpec(rank=8, targets="all-linear", dropout=0.05), "lora_dropout"),  # ParamWrapper refuses dropout
    (lora.LoraSpec(rank=8, targets=("down_proj",), target_parameters=("mlp.down_proj.weight",)), "also adapts"),
])
def test_what_peft_refuses_on_parameters(inventories, spec, match):
    """What PEFT 0.22 refuses on a transformers-5 MoE and on parameters (each tried: get_peft_model raises)."""
    with pytest.raises(SettingsError, match=match):
        lora.apply(inventories("llama-3-8b" if spec.target_parameters else "mixtral-8x7b"), spec)


def test_fused_expert_adapters_mixtral(inventories):
    """all-linear on Mixtral-8x7B: the attention's lora.Linear, the router's and both expert stacks' ParamWrapper,
    gate_up_proj at rank 2r: lora_A [2r * 8, 4096], lora_B [28672, 2r * 8] and down_proj's [r * 8, 14336],
    [4096, r * 8] per layer."""
    base = inventories("mixtral-8x7b")
    inv = lora.apply(base, lora.LoraSpec(rank=16, targets="all-linear"))
    attn = 16 * (4096 + 4096) * 2 + 16 * (4096 + 1024) * 2
    router = 16 * (4096 + 8)
    experts = 32 * 8 * (4096 + 28672) + 16 * 8 * (14336 + 4096)
    assert inv.trainable_params == 32 * (attn + router + experts)
    assert len(inv.param_adapted) == 32 * 3
    assert any("expert stacks, in the activations" in n for n in inv.notes)


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
    from memplan.activations.tracing import trace_profile

    cfg, inv = _tiny("llama-3-8b")
    spec = lora.LoraSpec(rank=8, targets="all-linear")
    full = trace_profile(cfg, seq_len=64, recipe="deepspeed-bf16", attention="flash", recompute="none", device="cpu")
    ad = trace_profile({**cfg, "lora": spec.trace_fields()}, seq_len=64, recipe="deepspeed-bf16",
                       attention="flash", recompute="none", device="cpu")
    a, f = ad["saved_for_backward"], full["saved_for_backward"]
    assert 0 < a[0] + a[1] < f[0] + f[1]
    assert 0 < sum(ad["live_after_forward"]) < sum(full["live_after_forward"])
    # one block, per sequence of 64 tokens at hidden 256, exactly: LlamaRMSNorm's `self.weight * hidden_states` saves
    # its bf16 input for the weight's gradient only when the weight trains (two norms a block); PEFT's
    # `lora_B(lora_A(dropout(x))) * scaling` adds lora_A's [s, r] output, saved by lora_B, on each of the 7 linears
    # (lora_A shares x with the frozen base layer; the scalar product saves nothing)
    s, h, r = 64, cfg["hidden_size"], 8
    assert full["per_layer"][1] - ad["per_layer"][1] == 2 * s * h * 2 - 7 * s * r * 2


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
    s = options.resolve(inv, JobRequest.of(gpus=8, strategy="fsdp-full", precision=recipe, lora=spec, activations="analytic")).settings
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


# ---- QLoRA: bitsandbytes' 4-bit base ----

def _q_bytes(n, dq):
    """bitsandbytes 0.50 quantize_4bit's storage for n elements (blocksize 64): packed uint8, the 16-entry fp32
    code, and fp32 absmax per block, or with double quantization uint8 absmax, an fp32 offset and state2's fp32
    absmax per 256 blocks and its 256-entry fp32 code."""
    blocks = -(-n // 64)
    base = (n + 1) // 2 + 16 * 4
    return base + (blocks + 4 + 4 * -(-blocks // 256) + 256 * 4 if dq else 4 * blocks)


@pytest.mark.parametrize("dq", [False, True])
def test_qlora_storage_llama3_8b(inventories, dq):
    base = inventories("llama-3-8b")
    inv = lora.apply(base, lora.LoraSpec(rank=16, quantize="nf4", double_quant=dq))
    layer = {"q": 4096 * 4096, "k": 1024 * 4096, "v": 1024 * 4096, "o": 4096 * 4096, "mlp": 14336 * 4096}
    per_block = [layer["q"], layer["k"], layer["v"], layer["o"]] + [layer["mlp"]] * 3
    assert inv.quantized_params == 32 * sum(per_block) == 6_979_321_856
    assert inv.quantized_bytes == 32 * sum(_q_bytes(n, dq) for n in per_block) + (256 * 4 if dq else 0)
    assert inv.quantized_bytes == (3_600_662_400 if dq else 3_925_882_880)
    # the head, embeddings and norms stay float parameters; adapters train
    assert inv.num_params + inv.quantized_params == base.num_params + inv.trainable_params
    assert any(t.name == "lm_head.weight" for t in inv.tensors)
    assert not any(t.name.endswith("proj.weight") for t in inv.tensors)


def test_qlora_model_states(inventories):
    base = inventories("llama-3-8b")
    spec = lora.LoraSpec(rank=16, targets="all-linear", quantize="nf4", double_quant=True)
    inv = lora.apply(base, spec)
    for strategy, gpus in (("single", 1), ("ddp", 8), ("zero2", 8)):
        s = options.resolve(inv, JobRequest.of(gpus=gpus, strategy=strategy, lora=spec, activations="analytic")).settings
        p = accounting.estimate(inv, s)
        float_numel = accounting.layouts.layout_sizes(inv, s.strategy.layout, gpus, 0).shard_numel \
            if strategy == "zero2" else inv.num_params
        assert p.peak.weights_bytes == s.recipe.param_bytes * float_numel + inv.quantized_bytes + \
            inv.buffer_bytes(s.recipe.half_buffers, 512)
        if strategy != "zero2":  # AdamW's two fp32 states, for the adapters only
            assert p.peak.optimizer_states_bytes == 2 * 4 * inv.trainable_params


@pytest.mark.parametrize("strategy", ["zero3", "fsdp-full-v1"])
def test_qlora_uint8_under_zero3_and_fsdp1_is_refused(inventories, strategy):
    # ZeRO-3 partitions every parameter, FSDP1 flattens a block's into one dtype: a uint8 storage is refused (a
    # float one is modelled)
    spec = lora.LoraSpec(rank=8, quantize="nf4", quant_storage="uint8")
    inv = lora.apply(inventories("llama-3-8b"), spec)
    kw = dict(strategy="fsdp-full", fsdp_version=1) if strategy == "fsdp-full-v1" else dict(strategy=strategy)
    with pytest.raises(SettingsError, match="FSDP1|ZeRO-3"):
        options.resolve(inv, JobRequest.of(gpus=8, lora=spec, activations="analytic", precision="deepspeed-bf16"
                                           if strategy == "zero3" else "pure-bf16", **kw))


@pytest.mark.parametrize("storage,precision,why", [
    ("bfloat16", "torch-amp", "stored float32"),  # the packed parameters would be counted (and cast) as fp32
    ("float32", "fsdp-bf16", "MixedPrecisionPolicy"),  # the all-gather's cast would turn codes into numbers
])
def test_fsdp_qlora_storage_must_be_the_stored_dtype(inventories, storage, precision, why):
    spec = lora.LoraSpec(rank=8, quantize="nf4", quant_storage=storage)
    inv = lora.apply(inventories("llama-3-8b"), spec)
    with pytest.raises(SettingsError, match=why):
        options.resolve(inv, JobRequest.of(gpus=8, strategy="fsdp-full", precision=precision, lora=spec,
                                           activations="analytic"))


def test_quant_storage_without_a_4bit_base_is_refused():
    with pytest.raises(SettingsError, match="--quantize-base"):
        lora.LoraSpec(rank=8, quant_storage="bfloat16")
    with pytest.raises(SettingsError, match="--quant-storage must be"):
        lora.LoraSpec(rank=8, quantize="nf4", quant_storage="int4")


@pytest.mark.parametrize("strategy,gpus", [("fsdp-full", 8), ("hsdp", 8), ("fsdp-full", 1)])
def test_fsdp_qlora_shards_a_float_storage_and_keeps_uint8_whole(inventories, strategy, gpus):
    """bnb_4bit_quant_storage=bfloat16: each 4-bit weight is a frozen bf16 parameter of (n + 1) // 4 elements that
    FSDP2 shards with the rest, its QuantState whole; uint8: Accelerate passes it as ignored_params, whole."""
    base = inventories("llama-3-8b")
    kw = dict(gpus=gpus, strategy=strategy, precision="pure-bf16", activations="analytic",
              **({"hsdp_shard_size": 4} if strategy == "hsdp" else {}))
    out = {}
    for storage in ("uint8", "bfloat16"):
        spec = lora.LoraSpec(rank=16, targets="all-linear", quantize="nf4", double_quant=True, quant_storage=storage)
        inv = lora.apply(base, spec)
        r = options.resolve(inv, JobRequest.of(lora=spec, **kw))
        out[storage] = (inv, accounting.estimate(inv, r.settings), r)
    (u8, pu8, _), (bf, pbf, rbf) = out["uint8"], out["bfloat16"]
    assert u8.model_params == bf.model_params == base.num_params + u8.trainable_params
    assert u8.quantized_storage_bytes == bf.quantized_storage_bytes  # the same bytes, packed either way
    packed = [t for t in bf.tensors if t.packs]
    assert len(packed) == 224 and all(t.dtype == "bfloat16" and t.numel == (t.packs + 1) // 4 for t in packed)
    assert not any(t.packs for t in u8.tensors) and not any(t.packs for t in bf.quantized)
    shard = 1 if gpus == 1 else (4 if strategy == "hsdp" else gpus)
    lay_u8, lay_bf = pu8.peak.weights_bytes - u8.quantized_bytes, pbf.peak.weights_bytes - bf.quantized_bytes
    # the float parameters' shards (FSDP2 pads dim 0): uint8 keeps the packed codes outside them
    assert lay_bf - lay_u8 >= 2 * sum(t.numel for t in packed) // shard
    if shard > 1:
        assert pbf.peak.weights_bytes < pu8.peak.weights_bytes
        assert any("FSDP2 shards like the other frozen weights" in n for n in rbf.notes)
    else:
        assert pbf.peak.weights_bytes == pu8.peak.weights_bytes


def test_qlora_refuses_a_saved_4bit_module(inventories):
    with pytest.raises(SettingsError, match="4-bit layer"):
        lora.apply(inventories("llama-3-8b"), lora.LoraSpec(rank=8, quantize="nf4",
                                                           modules_to_save=("gate_proj",)))


@pytest.mark.parametrize("name,targets", [("llama-3-8b", ("q_proj", "v_proj")), ("gpt2", "all-linear"),
                                          ("mixtral-8x7b", ("q_proj", "v_proj")), ("qwen2.5-7b", "all-linear")])
@pytest.mark.parametrize("storage", ["uint8", "float32"])
def test_qlora_inventory_equals_bitsandbytes_and_peft(name, targets, storage):
    """Built as the harness builds a QLoRA job (transformers' choice of layers, bitsandbytes Linear4bit quantized
    on the CPU, PEFT's get_peft_model): every parameter and quantisation-state byte as memplan counts it."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from memplan.harness.measure import attribute
    from memplan.harness.setup import bnb_4bit_config, peft_model
    from memplan.model.meta_builder import hf_config

    cfg, inv = _tiny(name)
    spec = lora.LoraSpec(rank=8, targets=targets, quantize="nf4", double_quant=True, quant_storage=storage)
    q = lora.apply(inv, spec)
    model = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.float32)
    fields = {**spec.trace_fields(), "quant_storage": storage}
    bnb_4bit_config(model, fields)
    model = peft_model(model, fields)
    import bitsandbytes as bnb

    with torch.no_grad():  # a first forward: Linear4bit casts its bias to the compute dtype, as in every step after
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    quantized = {n.removeprefix("base_model.model.").removesuffix(".weight") for n, p in model.named_parameters()
                 if isinstance(p, bnb.nn.Params4bit)}
    assert quantized == {t.name.removesuffix(".weight") for t in (*q.quantized, *q.tensors)
                         if t.name.endswith(".weight") and (t.packs or t.dtype == "uint8")}
    # fp32 float parameters (torch-amp, what prepare_model_for_kbit_training leaves) + the 4-bit storage (a float32
    # storage's packed codes among the parameters, (n + 1) // 8 fp32 elements each)
    assert attribute(model, None)["weights_bytes"] == 4 * q.num_params + q.quantized_bytes
    assert {n.removeprefix("base_model.model."): tuple(p.shape) for n, p in model.named_parameters()
            if isinstance(p, bnb.nn.Params4bit)} == {t.name: t.shape for t in (*q.quantized, *q.tensors)
                                                     if t.name.endswith(".weight") and (t.packs or t.dtype == "uint8")}
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == q.trainable_params


@pytest.mark.parametrize("strategy,gpus,upcast", [("single", 1, True), ("ddp", 8, True), ("zero2", 8, False),
                                                  ("fsdp-full", 8, False)])
def test_adapters_on_a_bf16_base_are_fp32(inventories, strategy, gpus, upcast):
    # get_peft_model(autocast_adapter_dtype=True) upcasts lora_A/lora_B on a bf16 base to fp32 (measured: PEFT
    # 0.21 on a bf16 llama, modules_to_save copies stay bf16); DeepSpeed casts the module after PEFT, FSDP keeps
    # the recipe
    spec = lora.LoraSpec(rank=16, targets="all-linear")
    inv = lora.apply(inventories("llama-3-8b"), spec)
    precision = "deepspeed-bf16" if strategy == "zero2" else "pure-bf16"
    s = options.resolve(inv, JobRequest.of(gpus=gpus, strategy=strategy, precision=precision, lora=spec, activations="analytic")).settings
    assert bool(s.recipe.adapter_bytes) == upcast
    if upcast:
        p = accounting.estimate(inv, s)
        assert inv.adapter_params == inv.trainable_params == 41_943_040
        assert p.peak.weights_bytes == 2 * inv.num_params + 2 * inv.adapter_params + inv.buffer_bytes(True, 512)
        assert p.peak.optimizer_states_bytes == 2 * 4 * inv.trainable_params
        assert (s.recipe.grad_bytes, s.recipe.state_bytes) == (4, 4)


@pytest.mark.parametrize("optimizer", ["adam8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor"])
def test_per_tensor_optimizers_keep_states_for_the_adapters_only(inventories, optimizer):
    from memplan.precision import get_optimizer, state_bytes

    spec = lora.LoraSpec(rank=16, quantize="nf4")
    inv = lora.apply(inventories("llama-3-8b"), spec)
    s = options.resolve(inv, JobRequest.of(gpus=1, optimizer=optimizer, lora=spec, activations="analytic")).settings
    p = accounting.estimate(inv, s)
    opt = get_optimizer(optimizer)
    assert p.peak.optimizer_states_bytes == state_bytes(opt, s.recipe, tuple((t.shape, t.numel)
                                                                             for t in inv.tensors if t.trainable))
    if optimizer == "paged_adamw_32bit":  # fp32 states whatever the recipe, one fused kernel (no scratch)
        assert p.peak.optimizer_states_bytes == 2 * 4 * inv.trainable_params
        assert accounting.optimizer_impl(s) == "fused"



def test_qlora_says_fused_experts_stay_unquantized(inventories):
    # transformers 5's fused experts are 3-D nn.Parameters: replace_with_bnb_linear converts nn.Linear only
    inv = lora.apply(inventories("mixtral-8x7b"), lora.LoraSpec(rank=8, targets=("q_proj", "v_proj"), quantize="nf4"))
    fused = [t for t in inv.tensors if len(t.shape) == 3]
    assert len(fused) == 64 and not any(t.trainable for t in fused)
    assert any(f"{sum(t.numel for t in fused):,} parameters of 64 fused MoE expert tensors" in n for n in inv.notes)
    dense = lora.apply(inventories("llama-3-8b"), lora.LoraSpec(rank=8, quantize="nf4"))
    assert not any("fused MoE" in n for n in dense.notes)


def test_adapter_config_with_target_parameters(tmp_path, inventories):
    p = tmp_path / "adapter_config.json"
    p.write_text('{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"], '
                 '"target_parameters": ["experts.gate_up_proj"]}')
    spec = lora.read_adapter_config(str(p))
    assert spec.target_parameters == ("experts.gate_up_proj",)
    inv = lora.apply(inventories("mixtral-8x7b"), spec)
    assert len(inv.param_adapted) == 32 and all(n.endswith("experts.gate_up_proj") for n in inv.param_adapted)
    # one that matches nothing: PEFT warns and adapts the modules alone; memplan notes it
    p.write_text('{"r": 8, "target_modules": ["q_proj"], "target_parameters": ["nope"]}')
    inv = lora.apply(inventories("mixtral-8x7b"), lora.read_adapter_config(str(p)))
    assert not inv.param_adapted and any("match no parameter" in n for n in inv.notes)
    p.write_text('{"r": 8, "target_parameters": [1]}')
    with pytest.raises(ConfigError, match="list of parameter names"):
        lora.read_adapter_config(str(p))


def test_zero3_qlora_partitions_the_packed_weights(inventories):
    # bnb_4bit_quant_storage=bfloat16 under deepspeed-bf16: every parameter (the packed codes among them) 2 bytes
    # an element, partitioned; each QuantState whole on every rank (measured: docs/accuracy-lora.md, weights exact)
    spec = lora.LoraSpec(rank=16, targets="all-linear", quantize="nf4", double_quant=True, quant_storage="bfloat16")
    inv = lora.apply(inventories("llama-3-8b"), spec)
    one, eight = (accounting.estimate(inv, options.resolve(inv, JobRequest.of(
        gpus=g, stage=3, lora=spec, activations="analytic")).settings).peak.weights_bytes for g in (1, 8))
    # the rotary buffers stay fp32: DeepSpeed casts parameters only (Recipe.casts_buffers)
    assert one == 2 * inv.num_params + inv.quantized_bytes + inv.buffer_bytes(False, 512)
    assert inv.quantized_bytes + (one - inv.quantized_bytes) // 8 <= eight < one // 6


def test_fsdp1_takes_pefts_units(inventories):
    """FSDP1 under PEFT (transformers' update_fsdp_plugin_peft: peft's fsdp_auto_wrap_policy): each block one frozen
    FlatParameter, each lora_A / lora_B its own; every FlatParameter padded to the shard group on its own, the
    optimizer stepping the adapters' shards only. Measured with the harness (docs/accuracy-lora.md, fsdp1 rows:
    weights and optimizer states exact)."""
    from memplan.layouts import round_up
    from memplan.model import wrap_units

    spec = lora.LoraSpec(rank=16, targets=("q_proj", "v_proj"))
    inv = lora.apply(inventories("llama-3-8b"), spec)
    n = 4
    s = _settings(inv, spec, "fsdp-full", n, precision="fp32", fsdp_version=1)
    units = wrap_units.units_for(inv, s)
    adapters = [t for t in units.tensors if t.trainable]
    assert adapters and all(t.unit == t.module for t in adapters)  # each lora_A / lora_B its own unit
    assert all(t.unit in (t.block, "<root>") for t in units.tensors if not t.trainable)  # the block, or the root
    flats: dict[str, int] = {}
    for t in units.tensors:
        key = t.unit or t.block
        flats[key] = flats.get(key, 0) + t.numel
    p = accounting.estimate(inv, s)
    assert p.peak.weights_bytes == 4 * sum(round_up(x, n) // n for x in flats.values()) + inv.buffer_bytes(False, 512)
    assert p.peak.optimizer_states_bytes == 2 * 4 * sum(round_up(t.numel, n) // n for t in adapters)
    # a block's frozen FlatParameter gets no gradient: the step holds the adapters' reduced shards alone, and no
    # phase more (the engine without frozen units would hold every block's fp32 shard: 4 bytes x its weights)
    shards = 4 * sum(round_up(t.numel, n) // n for t in adapters)
    assert {x.name: x.grads_bytes for x in p.phases}["optimizer-step"] == shards
    assert max(x.grads_bytes for x in p.phases) == shards


@pytest.mark.parametrize("kw,match", [
    (dict(precision="fsdp-bf16"), "MixedPrecision"),  # PEFT casts to the stored dtype: needs autocast beside it
    (dict(precision="fp32", fsdp_wrap="size:1000000"), "fsdp_auto_wrap_policy"),
    (dict(precision="pure-bf16", quantize=True), "uint8 storage"),  # one dtype per FlatParameter
])
def test_fsdp1_lora_refusals(inventories, kw, match):
    kw = dict(kw)
    spec = lora.LoraSpec(rank=16, targets="all-linear")
    if kw.pop("quantize", False):
        spec = replace(spec, quantize="nf4")
    inv = lora.apply(inventories("llama-3-8b"), spec)
    with pytest.raises(SettingsError, match=match):
        _settings(inv, spec, "fsdp-full", 4, fsdp_version=1, **kw)


def test_fsdp1_refuses_a_flat_parameter_mixing_frozen_and_trainable(inventories):
    spec = lora.LoraSpec(rank=16, targets=("q_proj",), bias="all")  # every bias trains beside frozen weights
    inv = lora.apply(inventories("qwen2.5-7b"), spec)  # Qwen2's q/k/v biases
    with pytest.raises(SettingsError, match="uniform requires_grad"):
        _settings(inv, spec, "fsdp-full", 4, fsdp_version=1, precision="fp32")


def test_param_wrapper_stand_in_computes_what_peft_does():
    """The trace's lora.ParamWrapper (activations/tracing/lora.py) on real tensors: PEFT's adapters copied in, the
    same output and the same adapter gradients, for an expert stack (baddbmm fold) and a 2-D router weight."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from memplan.activations.tracing.lora import param_wrapper_class

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=4, vocab_size=64)
    theirs = peft.get_peft_model(MixtralForCausalLM(cfg), peft.LoraConfig(r=2, target_modules="all-linear",
                                                                          init_lora_weights=False))
    moe = theirs.base_model.model.model.layers[0].mlp
    base = moe.experts.get_base_layer()
    wrapper = param_wrapper_class()
    # PEFT nests gate_up_proj (its first parameter) innermost, with the doubled rank
    ours = wrapper(wrapper(base, "gate_up_proj", 4, 1.0, None), "down_proj", 2, 1.0, None)
    with torch.no_grad():
        for mine, peft_layer in ((ours, moe.experts), (ours.base_layer, moe.experts.base_layer)):
            mine.lora_A.weight.copy_(peft_layer.lora_A["default"].weight)
            mine.lora_B.weight.copy_(peft_layer.lora_B["default"].weight)
            mine.scaling = peft_layer.scaling["default"]
    x = torch.randn(6, 32)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    w = torch.rand(6, 2)
    expected = moe.experts(x, idx, w)
    got = ours(x, idx, w)
    assert torch.allclose(got, expected, atol=1e-5)
    got.sum().backward()
    expected.sum().backward()
    assert torch.allclose(ours.lora_A.weight.grad, moe.experts.lora_A["default"].weight.grad, atol=1e-4)
    assert torch.allclose(ours.base_layer.lora_B.weight.grad, moe.experts.base_layer.lora_B["default"].weight.grad,
                          atol=1e-4)
    router = wrapper(moe.gate.get_base_layer(), "weight", 2, 1.0, None)
    with torch.no_grad():
        router.lora_A.weight.copy_(moe.gate.lora_A["default"].weight)
        router.lora_B.weight.copy_(moe.gate.lora_B["default"].weight)
        router.scaling = moe.gate.scaling["default"]
    h = torch.randn(6, 32)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(router(h), moe.gate(h)))


@pytest.mark.parametrize("needs,saved", [((True, True), 2), ((True, False), 1), ((False, True), 1)])
def test_grouped_mm_saves_what_torch_saves(needs, saved):
    """Experts through transformers' fallback op in the trace save what aten::_grouped_mm's autograd node saves:
    the input only where the weight needs a gradient, the weight only where the input does (a LoRA job's frozen
    experts keep nothing of their input: docs/accuracy-lora.md, Qwen2-MoE)."""
    import torch
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    from memplan.activations.substitutes import grouped_mm

    x = torch.randn(6, 8, requires_grad=needs[0])
    w = torch.randn(3, 8, 5, requires_grad=needs[1])
    offs = torch.tensor([2, 4, 6], dtype=torch.int32)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = grouped_mm()(x, w, offs)
    assert sum(t is not None for t in packed) == saved
    out.sum().backward()
    assert (x.grad is not None) == needs[0] and (w.grad is not None) == needs[1]
    if needs[0]:
        assert torch.allclose(x.grad, torch.cat([w[i].sum(1).expand(2, 8) for i in range(3)]), atol=1e-5)


def test_moe_conversion_table_is_transformers_and_pefts():
    """memplan's copy (model/lora.py, no torch on the fast path) of the model types PEFT 0.22 converts: exactly
    transformers' _MODEL_TO_CONVERSION_PATTERN entries whose pattern PEFT has a target mapping for."""
    pytest.importorskip("peft")
    from peft.utils import transformers_weight_conversion as twc

    theirs = {t: p for t, p in twc._MODEL_TO_CONVERSION_PATTERN.items() if p in twc._MOE_TARGET_MODULE_MAPPING}
    assert lora.MOE_CONVERSION == theirs
    assert {k: tuple(v.items()) for k, v in twc._MOE_TARGET_MODULE_MAPPING.items()} == \
        lora.MOE_TARGET_MODULE_MAPPING
    assert {k: {n: tuple(o) for n, o in v.items()} for k, v in twc._MOE_FUSED_TARGETS.items()} == \
        lora.MOE_FUSED_TARGETS


def test_a_small_bf16_gemm_keeps_its_scratch_point():
    """oneDNN takes no scratch for a bf16 GEMM of m*n*k <= 4096 and some above: the trace keeps the point (0 bytes)
    so that traces at micro-batch 2 and 4 run the same points (Qwen2-MoE's [tokens, 1] shared-expert gate under
    LoRA crosses it; it fell back to the analytic profile before). An op that never takes scratch has none."""
    import torch

    from memplan.activations.substitutes import gemm_scratch

    scratch = gemm_scratch("avx512_bf16")
    mm = torch.ops.aten.mm.default
    a, b = torch.zeros(256, 16, dtype=torch.bfloat16), torch.zeros(16, 1, dtype=torch.bfloat16)
    assert scratch(mm, (a, b), a @ b) == 0
    a2 = torch.zeros(512, 16, dtype=torch.bfloat16)
    assert scratch(mm, (a2, b), a2 @ b) == 128 * 32 + 256 * 256 + 1024
    assert scratch(mm, (a.float(), b.float()), a.float() @ b.float()) is None
    assert scratch(torch.ops.aten.add.Tensor, (a, a), a + a) is None
