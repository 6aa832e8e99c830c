"""Parameters that require a gradient no loss reads (memplan/frameworks/__init__.py with_unreached): the traced step
finds them, and each framework trains them as it does: no gradient and no state on one GPU, under DDP (which still
buckets them) and FSDP2; states for all of a flat parameter under FSDP1 and DeepSpeed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.model.freeze import traced_unreached

BART = Path(__file__).resolve().parents[1] / "data" / "configs" / "bart-large.json"


def _causal_bart() -> dict:
    """BartForCausalLM at 4 decoder blocks, hidden 64: a decoder whose cross-attention has no encoder to read."""
    cfg = json.loads(BART.read_text())
    return {**cfg, "architectures": ["BartForCausalLM"], "is_encoder_decoder": False, "d_model": 64,
            "decoder_layers": 4, "encoder_layers": 4, "decoder_attention_heads": 2, "encoder_attention_heads": 2,
            "decoder_ffn_dim": 128, "encoder_ffn_dim": 128, "vocab_size": 512, "max_position_embeddings": 256}


def test_a_parameter_unread_in_every_traced_block_stands_for_every_block():
    pytest.importorskip("transformers")
    from memplan.model.meta_builder import build_meta_from_config

    inv = build_meta_from_config(_causal_bart(), "bart", "test")
    traced = ["model.decoder.layers.0.encoder_attn.k_proj.weight", "model.decoder.layers.1.encoder_attn.k_proj.weight",
              "model.decoder.layers.1.fc1.weight"]  # fc1: unread in one traced block only, so not mapped
    got = traced_unreached(inv, traced, ["model.decoder.layers.0", "model.decoder.layers.1"])
    assert got == tuple(f"model.decoder.layers.{i}.encoder_attn.k_proj.weight" for i in range(4))
    # traced at the model's own depth: by name
    blocks = [f"model.decoder.layers.{i}" for i in range(4)]
    assert traced_unreached(inv, traced, blocks) == tuple(sorted(traced))


def test_a_lora_adapter_no_loss_reads_is_mapped_onto_peft_s_name():
    """The traced step's adapters are lora_A/lora_B modules (tracing/lora.py); PEFT keeps them in a ModuleDict by
    adapter name (lora_A.default.weight). PEFT's default targets on BartForCausalLM (q_proj, v_proj) adapt the
    cross-attention too: those adapters get no gradient, and the job trains half of what PEFT adds."""
    pytest.importorskip("transformers")
    from memplan import options
    from memplan.model import lora
    from memplan.model.freeze import modules
    from memplan.model.meta_builder import build_meta_from_config
    from memplan.request import JobRequest

    cfg = _causal_bart()
    spec = lora.LoraSpec(rank=4)
    adapted = lora.apply(build_meta_from_config(cfg, "bart", "test"), spec)
    r = options.resolve(adapted, JobRequest.of(device="cpu", micro_batch=2, seq_len=64, precision="fp32", lora=spec),
                        config=cfg)
    cross = sorted(t.name for t in adapted.tensors if ".encoder_attn." in t.name and t.trainable)
    assert cross and all(".lora_" in n and ".default." in n for n in cross)
    assert sorted(r.settings.unreached) == cross
    assert modules(cross, adapted) == [f"model.decoder.layers.{i}.encoder_attn" for i in range(4)]
    assert any("get no gradient in the traced step (no loss reads them: model.decoder.layers.0.encoder_attn" in n
               for n in r.notes)


def test_modules_names_whole_modules_and_ranges_of_layers():
    """The note's module paths: a module whose trainable parameters are all named stands for them, and consecutive
    layers of one stack are one range (not layers 0 and 2 as 0-2)."""
    pytest.importorskip("transformers")
    from memplan.model.freeze import modules
    from memplan.model.meta_builder import build_meta_from_config

    inv = build_meta_from_config(_causal_bart(), "bart", "test")
    names = [t.name for t in inv.tensors if t.name.startswith(("model.decoder.layers.0.", "model.decoder.layers.1.",
                                                                "model.decoder.layers.3."))]
    assert modules(names, inv) == ["model.decoder.layers.0-1", "model.decoder.layers.3"]
    one = ["model.decoder.layers.2.fc1.weight"]
    assert modules(one, inv) == one


def test_each_framework_trains_unread_parameters_as_it_does():
    """BartForCausalLM's cross-attention (no encoder) gets no gradient: the trace finds it; one GPU and FSDP2 make it
    no state, DDP no state but buckets it, DeepSpeed ZeRO and FSDP1 keep states for it (measured on the CPU
    harness: BartForCausalLM, 2 blocks, hidden 256, every model state exact under DDP, FSDP2, FSDP1 and ZeRO-3)."""
    pytest.importorskip("transformers")
    from memplan import accounting, frameworks, options
    from memplan.model.meta_builder import build_meta_from_config
    from memplan.request import JobRequest

    cfg = _causal_bart()
    inv = build_meta_from_config(cfg, "bart", "test")
    cross = sum(t.numel for t in inv.tensors if ".encoder_attn" in t.name)
    assert cross > 0

    def plan(**kw):
        r = options.resolve(inv, JobRequest.of(device="cpu", micro_batch=2, seq_len=64, **kw), config=cfg)
        return r, accounting.estimate(inv, r.settings)

    r, single = plan(strategy="single", precision="fp32")
    assert set(r.settings.unreached) == {t.name for t in inv.tensors if ".encoder_attn" in t.name}
    assert any("get no gradient in the traced step" in n for n in r.notes)
    assert single.peak.optimizer_states_bytes == 8 * (inv.trainable_params - cross)
    _, ddp = plan(strategy="ddp", precision="fp32", gpus=2)
    assert ddp.peak.optimizer_states_bytes == 8 * (inv.trainable_params - cross)
    trained = frameworks.with_unreached(inv, ddp.settings)
    assert trained.unused_params == cross and trained.trainable_params == inv.trainable_params - cross
    _, z3 = plan(stage=3, precision="deepspeed-bf16", gpus=2)
    assert frameworks.with_unreached(inv, z3.settings) is inv
    # FSDP1: every decoder block's FlatParameter holds read parameters too, so all of them train
    _, f1 = plan(strategy="fsdp-full", precision="fsdp-bf16", gpus=2, fsdp_version=1)
    assert frameworks.with_unreached(inv, f1.settings) is inv


def test_ddp_with_unread_parameters_buckets_by_size_from_the_start():
    """find_unused_parameters=True: DDP assigns the buckets by size at construction ([1 MiB, 25 MiB], parameters in
    module order: distributed.py compute_bucket_size_limits) and never rebuilds them (reducer.h
    should_rebuild_buckets), so the replay has one release order, not the rebuild's two."""
    pytest.importorskip("transformers")
    from memplan import accounting, options
    from memplan.model.meta_builder import build_meta_from_config
    from memplan.request import JobRequest

    cfg = _causal_bart()
    inv = build_meta_from_config(cfg, "bart", "test")
    r = options.resolve(inv, JobRequest.of(device="cuda", gpus=2, strategy="ddp", precision="torch-amp",
                                           micro_batch=2, seq_len=64, gpu="h100-80g"), config=cfg)
    plan = accounting.estimate(inv, r.settings)
    assert list(plan.reserved.variants) == ["find_unused_parameters: buckets by size, kept"]
    assert plan.reserved_peak_bytes >= plan.peak_bytes


def test_ddp_buckets_the_unread_parameters_with_gradient_as_bucket_view_too():
    """With gradient_as_bucket_view the grads are views of the buckets, so the buckets add nothing beside them, but
    an unread parameter's part of its bucket holds no gradient: it is counted, with the Reducer's int32 map of the
    parameters used (local_used_map_dev_), 4 bytes a parameter."""
    pytest.importorskip("transformers")
    from memplan import accounting, frameworks, options
    from memplan.model.meta_builder import build_meta_from_config
    from memplan.request import JobRequest

    cfg = _causal_bart()
    inv = build_meta_from_config(cfg, "bart", "test")

    def plan(**kw):
        r = options.resolve(inv, JobRequest.of(device="cpu", micro_batch=2, seq_len=64, precision="fp32", **kw),
                            config=cfg)
        return accounting.estimate(inv, r.settings)

    single, view = plan(strategy="single"), plan(strategy="ddp", gpus=2, gradient_as_bucket_view=True)
    trained = frameworks.with_unreached(inv, view.settings)
    assert view.phases[0].buffers_bytes - single.phases[0].buffers_bytes == \
        4 * trained.unused_params + 4 * sum(1 for t in trained.tensors if t.trainable or t.unused)
