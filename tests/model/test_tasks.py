"""The model's head from its config's architectures (memplan/model/tasks.py): the inventory, the traced step and
the harness build the same class and train it on its own loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.errors import ConfigError
from memplan.model import tasks
from memplan.request import JobRequest

BERT = Path(__file__).resolve().parents[1] / "data" / "configs" / "bert-seq-cls.json"


def test_task_from_the_class_suffix():
    assert tasks.task_of({"architectures": ["LlamaForCausalLM"]}) == tasks.CAUSAL_LM
    assert tasks.task_of({"architectures": ["GPT2LMHeadModel"]}) == tasks.CAUSAL_LM
    assert tasks.task_of({}) == tasks.CAUSAL_LM  # no class named: a causal LM, as before
    assert tasks.task_of({"architectures": ["BertForSequenceClassification"]}) == "sequence-classification"
    assert tasks.task_of({"architectures": ["RobertaForTokenClassification"]}) == "token-classification"
    assert tasks.task_of({"architectures": ["BertForMaskedLM"]}) == "masked-lm"
    assert tasks.task_of({"architectures": ["LlamaForSequenceClassification"]}) == "sequence-classification"
    assert tasks.task_of({"architectures": ["BertForQuestionAnswering"]}) == "question-answering"
    for arch in ("ViTForImageClassification", "BertForPreTraining", "LlavaForConditionalGeneration",
                 "BertForMultipleChoice"):
        with pytest.raises(ConfigError, match=arch):
            tasks.task_of({"architectures": [arch]})
    # a speech seq2seq (features in, not token ids) and a vision-language model memplan does not model: refused
    # by name (LLaVA and Gemma 3 are modelled: test_a_vision_language_model_s_images_are_tokens_in_its_sequence)
    for arch, model_type in (("WhisperForConditionalGeneration", "whisper"),
                             ("Idefics3ForConditionalGeneration", "idefics3")):
        with pytest.raises(ConfigError, match=arch):
            tasks.task_of({"architectures": [arch], "model_type": model_type, "is_encoder_decoder": True})
    assert tasks.num_labels({}) == 2 and tasks.num_labels({"num_labels": 5}) == 5
    assert tasks.num_labels({"id2label": {"0": "a", "1": "b", "2": "c"}}) == 3


def test_bert_classifier_inventory_and_trace():
    """BertForSequenceClassification: the pooler and the classifier in the inventory (transformers' own count),
    and a traced step whose loss is the classifier's (no vocabulary-sized logits)."""
    pytest.importorskip("torch")
    from memplan import accounting, options
    from memplan.model import sources

    src = sources.resolve(str(BERT))
    inv = sources.build_inventory(src)
    assert inv.num_params == 109_483_778  # bert-base 109,482,240 + classifier 768 x 2 + 2
    assert any(t.name == "classifier.weight" and t.shape == (2, 768) for t in inv.tensors)
    s = options.resolve(inv, JobRequest.of(gpus=1, micro_batch=4, seq_len=512, device="cuda"), config=src.config).settings
    plan = accounting.estimate(inv, s)
    assert type(s.activation_profile).__name__ == "TracedProfile"  # not the analytic fallback of a failed trace
    # the masked-LM head of the same encoder holds vocabulary-sized logits: more activations
    cfg = dict(json.loads(BERT.read_text()), architectures=["BertForMaskedLM"])
    mlm_src = sources.ModelSource(name="bert-mlm", kind="config", config=cfg, description="test")
    mlm = sources.build_inventory(mlm_src)
    s2 = options.resolve(mlm, JobRequest.of(gpus=1, micro_batch=4, seq_len=512, device="cuda"), config=cfg).settings
    mlm_plan = accounting.estimate(mlm, s2)
    act = max(p.activations_bytes for p in plan.phases)
    assert max(p.activations_bytes for p in mlm_plan.phases) > act + 4 * 512 * 30522 * 2


def test_a_head_memplan_does_not_model_is_one_line(tmp_path):
    import subprocess
    import sys

    d = tmp_path / "idefics3"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Idefics3ForConditionalGeneration"],
                                               "model_type": "idefics3", "text_config": {"model_type": "llama"}}))
    r = subprocess.run([sys.executable, "-m", "memplan", "estimate", str(d)], capture_output=True, text=True)
    code, out, err = r.returncode, r.stdout, r.stderr
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "ConditionalGeneration" in err


def test_a_vision_language_model_s_bad_input_is_one_line(tmp_path):
    import subprocess
    import sys

    from clirun import run_cli

    bad = tmp_path / "llava-bad.json"
    cfg = json.loads(LLAVA.read_text())
    bad.write_text(json.dumps(dict(cfg, vision_config=dict(cfg["vision_config"], image_size=30))))
    for argv, needle in ((["llava-1.5-7b", "--seq-len", "512"], "--seq-len 512: 1 image(s) of 576 tokens"),
                         (["llava-1.5-7b", "--images", "-1"], "--images must be 0 or more"),
                         (["llama-3-8b", "--images", "1"], "only a vision-language model"),
                         (["gemma-3-4b", "--tp", "2", "--gpus", "2"], "a vision-language (image-text-to-text)"),
                         (["gemma-3-4b", "--activations", "analytic"], "a vision-language model's"),
                         (["llama-3-8b", "--freeze", "vision"], "this model has none"),
                         (["gemma-3-4b", "--freeze", "model.nothing"], "no parameter of gemma-3-4b lies under it"),
                         (["gemma-3-4b", "--freeze", "model"], "nothing trains"),
                         (["gemma-3-4b", "--freeze", "vision", "--lora-rank", "8", "--lora-targets", "all-linear"],
                          "--freeze with LoRA"),
                         ([str(bad)], "image_size 30 is not a multiple of patch_size 8"),
                         (["qwen2.5-vl-7b", "--image-size", "500"], "multiples of 28 px"),
                         (["qwen2.5-vl-7b", "--image-size", "4x"], "give pixels, N (a square) or HxW"),
                         (["qwen2.5-vl-7b", "--image-size", "0x28"], "at least one pixel"),
                         (["qwen2.5-vl-7b", "--image-size", "980", "--seq-len", "1200"], "or a smaller --image-size"),
                         (["llava-1.5-7b", "--image-size", "336"], "takes images of its config's image_size (336 px)"),
                         (["llama-3-8b", "--image-size", "448"], "only a vision-language model"),
                         ([str(QWEN35), "--image-size", "50x64"], "multiples of 32 px")):
        code, out, err = run_cli(["estimate", *argv])
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (argv, err)
        assert needle in err, (argv, err)
    # and one through a fresh interpreter, as a user runs it
    r = subprocess.run([sys.executable, "-m", "memplan", "estimate", "llava-1.5-7b", "--images", "-1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr



def test_task_flag_sets_the_head_from_transformers_auto_mapping():
    pytest.importorskip("transformers")
    bert = json.loads(BERT.read_text())
    assert tasks.with_task(bert, "masked-lm")["architectures"] == ["BertForMaskedLM"]
    assert tasks.with_task({"model_type": "llama"}, "sequence-classification")["architectures"] == [
        "LlamaForSequenceClassification"]
    assert tasks.with_task({"model_type": "gpt2"}, "causal-lm")["architectures"] == ["GPT2LMHeadModel"]
    with pytest.raises(ConfigError, match="one of causal-lm"):
        tasks.with_task(bert, "summarisation")
    with pytest.raises(ConfigError, match="no masked-lm head for model_type 'mixtral'"):
        tasks.with_task({"model_type": "mixtral"}, "masked-lm")


def test_plan_with_a_task_prints_a_command_that_reproduces_it():
    import subprocess
    import sys

    base = [sys.executable, "-m", "memplan"]
    r = subprocess.run(base + ["plan", str(BERT), "--task", "token-classification", "--gpu", "a100-40g",
                               "--seq-len", "512", "--json"], capture_output=True, text=True)
    rec = json.loads(r.stdout)["recommendation"]
    assert "--task token-classification" in rec["command"]
    argv = rec["command"].split()[1:] + ["--json"]
    again = json.loads(subprocess.run(base + argv, capture_output=True, text=True).stdout)["per_gpu"]
    assert (again["required_bytes"], again["peak_bytes"]) == (rec["required_bytes"], rec["peak_bytes"])


VIT = Path(__file__).resolve().parents[1] / "data" / "configs" / "vit-base.json"


def test_a_vision_transformer_s_sequence_is_its_patches():
    vit = json.loads(VIT.read_text())
    assert tasks.task_of(vit) == tasks.IMAGE
    assert tasks.image_tokens(vit) == 197  # (224 / 16)^2 + the class token
    assert tasks.image_tokens(dict(vit, model_type="deit")) == 198  # and DeiT's distillation token
    assert tasks.check_seq_len(vit, None) == 197 and tasks.check_seq_len(vit, 197) == 197
    with pytest.raises(ConfigError, match="197 at image_size 224"):
        tasks.check_seq_len(vit, 2048)
    with pytest.raises(ConfigError, match="not a multiple of patch_size"):
        tasks.image_tokens(dict(vit, image_size=230))
    with pytest.raises(ConfigError, match="vision transformers"):
        tasks.task_of({"architectures": ["ResNetForImageClassification"], "model_type": "resnet"})


def test_vit_inventory_and_trace():
    """ViT-B/16 with 1,000 classes: 86,567,656 parameters (transformers' own count), the job at 197 tokens, its
    step traced with the batch of images made in it (counted: the patch embedding keeps it for backward)."""
    pytest.importorskip("torch")
    from memplan import accounting, options
    from memplan.model import sources

    src = sources.resolve(str(VIT))
    inv = sources.build_inventory(src)
    assert inv.num_params == 86_567_656
    assert [b.name for b in inv.layer_blocks][:2] == ["vit.layers.0", "vit.layers.1"]
    s = options.resolve(inv, JobRequest.of(gpus=1, micro_batch=8, device="cuda"), config=src.config).settings
    assert s.seq_len == 197
    accounting.estimate(inv, s)
    assert type(s.activation_profile).__name__ == "TracedProfile"  # not the analytic fallback of a failed trace


def test_an_image_model_s_bad_input_is_one_line(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "vit-bad.json"
    bad.write_text(json.dumps(dict(json.loads(VIT.read_text()), image_size=230)))
    for argv, needle in (([str(VIT), "--seq-len", "2048"], "197 at image_size 224"),
                         ([str(bad)], "image_size 230 is not a multiple of patch_size 16")):
        r = subprocess.run([sys.executable, "-m", "memplan", "estimate", *argv], capture_output=True, text=True)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert needle in r.stderr


def test_the_auto_mappings_read_from_source_are_transformers_own():
    """--task reads modeling_auto.py's mappings as literals (importing it imports torch: 2 s, too slow for a
    refusal); they equal the module's own."""
    pytest.importorskip("torch")
    from transformers.models.auto import modeling_auto

    for name in tasks.AUTO_MAPPINGS.values():
        assert tasks.auto_class_mapping(name) == dict(getattr(modeling_auto, name)), name


def test_lora_default_targets_are_peft_s():
    """memplan's LoRA defaults (model/lora.py DEFAULT_TARGETS) are PEFT 0.22's mapping, whole: an encoder's query
    and value (BERT, RoBERTa) among them."""
    peft_constants = pytest.importorskip("peft.utils.constants")
    from memplan.model.lora import DEFAULT_TARGETS

    want = peft_constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    assert set(DEFAULT_TARGETS) == set(want)
    for k, v in want.items():
        assert DEFAULT_TARGETS[k] == (v if isinstance(v, str) else tuple(v)), k
    assert DEFAULT_TARGETS["bert"] == ("query", "value")


def test_an_encoder_s_sequence_stops_at_its_learned_positions():
    """BERT learns max_position_embeddings absolute positions: its job defaults to them and refuses longer; a
    causal LM keeps memplan's default (its warning says when it runs past them)."""
    bert = json.loads(BERT.read_text())
    assert tasks.check_seq_len(bert, None) == 512 and tasks.check_seq_len(bert, 128) == 128
    with pytest.raises(ConfigError, match="learns 512 absolute positions"):
        tasks.check_seq_len(bert, 1024)
    assert tasks.check_seq_len(dict(bert, position_embedding_type="relative_key"), 1024) == 1024
    assert tasks.check_seq_len(dict(bert, architectures=["BertLMHeadModel"]), None) is None
    for bad in (0, -3, "x", True):
        with pytest.raises(ConfigError, match="at least one label"):
            tasks.check_labels(dict(bert, num_labels=bad))
    tasks.check_labels(dict(bert, num_labels=1))  # one label: a regression head


T5 = Path(__file__).resolve().parents[1] / "data" / "configs" / "flan-t5-base.json"
BART = Path(__file__).resolve().parents[1] / "data" / "configs" / "bart-large.json"


def test_an_encoder_decoder_trains_as_seq2seq():
    """transformers' seq2seq LM mapping decides: T5's and BART's own classes, and a base model's checkpoint that
    sets is_encoder_decoder (bart-large's BartModel) with the class AutoModelForSeq2SeqLM builds; T5's encoder
    alone is not one."""
    t5, bart = json.loads(T5.read_text()), json.loads(BART.read_text())
    assert tasks.task_of(t5) == tasks.SEQ2SEQ and tasks.seq2seq_class(t5) == "T5ForConditionalGeneration"
    assert tasks.task_of(bart) == tasks.SEQ2SEQ and tasks.seq2seq_class(bart) == "BartForConditionalGeneration"
    assert tasks.task_of({"architectures": ["MarianMTModel"], "model_type": "marian"}) == tasks.SEQ2SEQ
    assert tasks.task_of(dict(t5, architectures=["T5EncoderModel"])) != tasks.SEQ2SEQ
    assert tasks.with_task(dict(bart, architectures=["BartForSequenceClassification"]), tasks.SEQ2SEQ)[
        "architectures"] == ["BartForConditionalGeneration"]
    assert tasks.seq2seq_layers(t5) == (12, 12) and tasks.seq2seq_layers(bart) == (12, 12)
    assert tasks.seq2seq_layers(dict(t5, num_decoder_layers=None)) == (12, 12)  # T5Config: num_layers
    # lengths: the decoder's defaults to the encoder's; BART's learned positions bound both
    assert tasks.check_target_len(t5, None, 512) == 512 and tasks.check_target_len(t5, 64, 512) == 64
    assert tasks.check_seq_len(bart, None) == 1024 and tasks.check_seq_len(t5, None) is None
    with pytest.raises(ConfigError, match="a longer target does not run"):
        tasks.check_target_len(bart, 1025, 512)
    with pytest.raises(ConfigError, match="only an encoder-decoder"):
        tasks.check_target_len({"architectures": ["LlamaForCausalLM"]}, 64, 512)
    with pytest.raises(ConfigError, match="nests encoder, decoder"):
        tasks.task_of({"architectures": ["T5GemmaForConditionalGeneration"], "model_type": "t5gemma",
                       "encoder": {}, "decoder": {}})


@pytest.mark.parametrize("path,params", [pytest.param(T5, 222_903_552, marks=pytest.mark.slow),  # (with -m slow: the quick suite's 15-minute budget on 2 cores)
                                         (BART, 406_291_456)])
def test_seq2seq_inventory_and_trace(path, params):
    """flan-t5-base and bart-large: parameters exact against transformers' own count (transformers 5 ties T5's head
    to its shared embedding whatever the config says: configuration_t5.py), both stacks' blocks, encoder first,
    and a traced step (not the analytic fallback) at 256 tokens in and 64 out."""
    torch = pytest.importorskip("torch")
    from memplan import accounting, options
    from memplan.model import sources
    from memplan.model.meta_builder import hf_config

    cfg = json.loads(path.read_text())
    with torch.device("meta"):
        model = tasks.build(cfg, hf_config(cfg))
    assert sum(p.numel() for p in model.parameters()) == params
    src = sources.resolve(str(path))
    inv = sources.build_inventory(src)
    assert inv.num_params == params and inv.task == tasks.SEQ2SEQ
    names = [b.name for b in inv.layer_blocks]
    assert len(names) == 24 and "encoder" in names[0] and "decoder" in names[-1]
    r = options.resolve(inv, JobRequest.of(gpus=1, micro_batch=2, seq_len=256, target_len=64, device="cuda"),
                        config=src.config)
    s = r.settings
    assert s.target_len == 64 and r.sources["target_len"] == "command line"
    plan = accounting.estimate(inv, s)
    assert type(s.activation_profile).__name__ == "TracedProfile"
    assert s.activation_profile.data["traced_layers"] == s.activation_profile.data["num_layers"] == 24
    # a longer target holds more: the decoder's activations and the vocabulary logits scale with it
    s2 = options.resolve(inv, JobRequest.of(gpus=1, micro_batch=2, seq_len=256, target_len=256, device="cuda"),
                         config=src.config).settings
    act = max(p.activations_bytes for p in plan.phases)
    assert max(p.activations_bytes for p in accounting.estimate(inv, s2).phases) > act


def test_an_encoder_decoder_without_sdpa_traces_transformers_eager_attention():
    """Pegasus-X has no SDPA attention (_supports_sdpa False): transformers runs it eager, and so does the trace,
    saying so, instead of failing on the sdpa it was asked for."""
    pytest.importorskip("torch")
    from transformers import AutoConfig

    from memplan import options
    from memplan.model import sources

    cfg = dict(AutoConfig.for_model("pegasus_x").to_dict(), architectures=["PegasusXForConditionalGeneration"],
               encoder_layers=2, decoder_layers=2, d_model=64, encoder_attention_heads=2, decoder_attention_heads=2,
               encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256)
    assert not tasks.sdpa_supported(cfg) and tasks.sdpa_supported(json.loads(T5.read_text()))
    src = sources.ModelSource(name="pegasus-x", kind="config", config=cfg, description="test")
    inv = sources.build_inventory(src)
    r = options.resolve(inv, JobRequest.of(gpus=1, seq_len=64, target_len=16, device="cuda"), config=cfg)
    assert type(r.settings.activation_profile).__name__ == "TracedProfile"
    assert any(n.startswith("attention: eager, as transformers runs it") for n in r.notes)


def test_qlora_leaves_the_class_s_fp32_modules_unquantized():
    """T5's _keep_in_fp32_modules ("wo"): transformers' bitsandbytes quantizer does not convert those layers
    (get_modules_to_not_convert), matched as should_convert_module matches names."""
    pytest.importorskip("torch")
    from memplan.model import lora, sources

    assert lora.kept_in_fp32("encoder.block.0.layer.1.DenseReluDense.wo", ("wo",))
    assert not lora.kept_in_fp32("encoder.block.0.layer.0.SelfAttention.o", ("wo",))
    assert lora.kept_in_fp32("model.layers.1.mlp", ("model.layers.1",))
    assert not lora.kept_in_fp32("model.layers.11.mlp", ("model.layers.1",))
    inv = sources.build_inventory(sources.resolve(str(T5)))
    assert inv.keep_fp32_modules == ("wo",)
    spec = lora.LoraSpec(rank=8, quantize="nf4")
    q = lora.apply(inv, spec)
    wo = [t for t in q.tensors if t.name.endswith("DenseReluDense.wo.weight")]
    assert len(wo) == 24 and all(t.dtype == "float32" for t in wo)  # kept whole, not in q.quantized
    assert not any("DenseReluDense.wo" in t.name for t in q.quantized)


def test_layerdrop_runs_every_layer_and_says_so():
    """LayerDrop draws `torch.rand([]) < layerdrop` per layer in training (modeling_m2m_100.py): the trace and the
    harness run every layer, the most a step holds, and the inventory's notes say so; scale_config scales a
    config that names its stacks' layers only (M2M100's encoder_layers, decoder_layers)."""
    from memplan.model.scaling import scale_config

    cfg = {"architectures": ["M2M100ForConditionalGeneration"], "model_type": "m2m_100", "is_encoder_decoder": True,
           "encoder_layers": 12, "decoder_layers": 12, "encoder_layerdrop": 0.05, "decoder_layerdrop": 0.0,
           "d_model": 1024, "encoder_attention_heads": 16, "decoder_attention_heads": 16, "encoder_ffn_dim": 4096,
           "decoder_ffn_dim": 4096, "vocab_size": 128112}
    traced = tasks.trace_config(cfg)
    assert traced["encoder_layerdrop"] == 0.0 and cfg["encoder_layerdrop"] == 0.05
    assert "encoder_layerdrop 0.05" in tasks.layerdrop_note(cfg) and tasks.layerdrop_note(traced) is None
    small, changes = scale_config(cfg, layers=2, hidden=256)
    assert (small["encoder_layers"], small["decoder_layers"]) == (2, 2)
    assert (small["encoder_attention_heads"], small["decoder_attention_heads"], small["d_model"]) == (4, 4, 256)
    assert small["encoder_ffn_dim"] == small["decoder_ffn_dim"] == 1024


LLAVA = Path(__file__).resolve().parents[1] / "data" / "configs" / "llava-tiny.json"
GEMMA3_VL = Path(__file__).resolve().parents[1] / "data" / "configs" / "gemma3-vl-tiny.json"
PALIGEMMA = Path(__file__).resolve().parents[1] / "data" / "configs" / "paligemma-tiny.json"


def test_a_vision_language_model_s_images_are_tokens_in_its_sequence():
    """LLaVA-1.5 at 336 px in 14 px patches: 576 tokens an image (CLIP's class token dropped by the default
    feature strategy, kept by "full"); Gemma 3: mm_tokens_per_image, 256. --images (default 1) must leave text in
    --seq-len; a text model takes no --images; a vision-language model memplan does not model is refused by name."""
    from memplan.model import sources

    llava, gemma = sources.resolve("llava-1.5-7b").config, sources.resolve("gemma-3-4b").config
    assert tasks.task_of(llava) == tasks.task_of(gemma) == tasks.IMAGE_TEXT
    assert tasks.image_text_tokens(llava) == 576 and tasks.image_text_tokens(gemma) == 256
    assert tasks.image_text_tokens(dict(llava, vision_feature_select_strategy="full")) == 577
    # a field left out takes its transformers class's default: the same tokens (LlavaConfig's "default" strategy,
    # Gemma3Config's 256 image tokens); none left out is read from the dict alone (a refusal needs no transformers)
    assert tasks.image_text_tokens({k: v for k, v in llava.items() if k != "vision_feature_select_strategy"}) == 576
    assert tasks.image_text_tokens({k: v for k, v in gemma.items() if k != "mm_tokens_per_image"}) == 256
    assert tasks.image_text_tokens({**llava, "vision_config": {"model_type": "clip_vision_model"}}) == 49  # 224/32
    assert tasks.stacks(llava) == 24 + 32 and tasks.stacks(gemma) == 27 + 34
    assert tasks.check_images(llava, None, 2048) == 1 and tasks.check_images(llava, 3, 2048) == 3
    assert tasks.check_images(llava, 0, 16) == 0  # text alone: the vision tower does not run
    assert tasks.check_images({"architectures": ["LlamaForCausalLM"]}, None, 2048) is None
    with pytest.raises(ConfigError, match="take 1152 tokens of the sequence and leave no text"):
        tasks.check_images(llava, 2, 1152)
    with pytest.raises(ConfigError, match="only a vision-language model takes images"):
        tasks.check_images({"architectures": ["LlamaForCausalLM"]}, 1, 2048)
    with pytest.raises(ConfigError, match="not a multiple of patch_size 14"):
        tasks.image_text_tokens(dict(llava, vision_config=dict(llava["vision_config"], image_size=330)))
    with pytest.raises(ConfigError, match="pools its 64 x 64 patches"):
        tasks.image_text_tokens(dict(gemma, mm_tokens_per_image=100))
    with pytest.raises(ConfigError, match="modelled for model_type llava, gemma3, paligemma, mllama, qwen2_vl, "
                                          "qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe, not 'idefics3'"):
        tasks.task_of({"architectures": ["Idefics3ForConditionalGeneration"], "model_type": "idefics3"})
    pali = json.loads(PALIGEMMA.read_text())
    assert tasks.task_of(pali) == tasks.IMAGE_TEXT and tasks.image_text_tokens(pali) == 16  # (32 / 8)^2


@pytest.mark.parametrize("preset,params,vision,text", [("llava-1.5-7b", 7_063_427_072, 24, 32),
                                                       ("gemma-3-4b", 4_300_079_472, 27, 34),
                                                       ("qwen2.5-vl-7b", 8_292_166_656, 32, 28)])
def test_a_vision_language_inventory_is_transformers_own(preset, params, vision, text):
    """The published configs of llava-hf/llava-1.5-7b-hf, google/gemma-3-4b-it and Qwen/Qwen2.5-VL-7B-Instruct (its
    flat transformers-4 layout, which transformers 5 nests): parameters exact against
    transformers' own count; the blocks are the vision tower's, then the language model's."""
    torch = pytest.importorskip("torch")
    from memplan.model import sources
    from memplan.model.meta_builder import hf_config

    cfg = sources.resolve(preset).config
    with torch.device("meta"):
        model = tasks.build(cfg, hf_config(cfg))
    assert sum(p.numel() for p in model.parameters()) == params
    inv = sources.build_inventory(sources.resolve(preset))
    assert inv.num_params == params and inv.task == tasks.IMAGE_TEXT
    names = [b.name for b in inv.layer_blocks]
    assert len(names) == vision + text and "vis" in names[0] and "language_model" in names[-1]
    assert inv.dims["hidden_size"] == model.config.get_text_config().hidden_size


MLLAMA = Path(__file__).resolve().parents[1] / "data" / "configs" / "mllama-tiny.json"


def test_mllama_reads_its_tiles_by_cross_attention():
    """Llama 3.2 Vision (Mllama): one <|image|> token per image in the text; the image as max_num_tiles tiles
    (the processor pads to them all); the language model's cross-attention layers read the tiles' features under
    the dense cross_attention_mask. The collator's labels ignore the image token, which is past the head's
    vocabulary. Parameters exact against transformers' own; --freeze vision freezes the vision model, not the
    projector."""
    torch = pytest.importorskip("torch")
    from memplan.model import freeze, sources
    from memplan.model.meta_builder import hf_config

    cfg = json.loads(MLLAMA.read_text())
    assert tasks.task_of(cfg) == tasks.IMAGE_TEXT and tasks.image_text_tokens(cfg) == tasks.image_span(cfg) == 1
    assert tasks.stacks(cfg) == 2 + 1 + 4  # local and global vision layers, then the language model's
    ids = torch.randint(0, 2048, (2, 32))
    got = tasks.step_inputs(tasks.IMAGE_TEXT, {**cfg, "memplan_images": 2}, ids, torch.bfloat16)
    assert (got["input_ids"][:, 1:3] == 2048).all() and (got["input_ids"][:, 3:] != 2048).all()
    assert (got["labels"][:, 1:3] == -100).all() and got["labels"].max() < 2048
    assert got["pixel_values"].shape == (2, 2, 4, 3, 56, 56) and got["pixel_values"].dtype == torch.bfloat16
    assert got["aspect_ratio_ids"].tolist() == [[6, 6], [6, 6]]  # (2, 2): every tile of the 4
    assert got["aspect_ratio_mask"].shape == (2, 2, 4) and got["cross_attention_mask"].shape == (2, 32, 2, 4)
    assert got["cross_attention_mask"][:, 0].sum() == 0 and got["cross_attention_mask"][:, 1:].all()
    with torch.device("meta"):
        model = tasks.build(cfg, hf_config(cfg))
    inv = sources.build_inventory(sources.resolve(str(MLLAMA)))
    assert inv.num_params == sum(p.numel() for p in model.parameters())
    frozen = freeze.paths("vision", cfg)
    assert frozen == ("model.vision_model",)
    with pytest.raises(ConfigError, match=r"takes images of its config's image_size \(56 px\)"):
        tasks.check_image_size(cfg, (448, 448))


@pytest.mark.parametrize("path", [LLAVA, GEMMA3_VL, PALIGEMMA, MLLAMA])
def test_a_vision_language_step_is_traced_with_its_images(path):
    """Both stacks traced at full depth, the images made in the step; more images per sample hold more (the
    vision tower's activations), and the same job gives the same bytes."""
    pytest.importorskip("torch")
    from memplan import accounting, options
    from memplan.model import sources

    src = sources.resolve(str(path))
    inv = sources.build_inventory(src)
    peaks = []
    for images in (1, 2, 2):
        r = options.resolve(inv, JobRequest.of(gpus=1, micro_batch=2, seq_len=128, images=images, device="cuda"),
                            config=src.config)
        s = r.settings
        assert s.images == images
        plan = accounting.estimate(inv, s)
        assert type(s.activation_profile).__name__ == "TracedProfile"
        data = s.activation_profile.data
        assert data["traced_layers"] == data["num_layers"] == tasks.stacks(src.config)
        assert data.get("alloc_events")  # the allocator replay runs on it
        peaks.append(plan.peak_bytes)
    assert peaks[0] < peaks[1] == peaks[2]


QWEN25_VL = Path(__file__).resolve().parents[1] / "data" / "configs" / "qwen2.5-vl-tiny.json"
QWEN3_VL = Path(__file__).resolve().parents[1] / "data" / "configs" / "qwen3-vl-tiny.json"


def test_a_qwen_vl_image_is_its_merged_patches_at_any_size():
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: an image of H x W px is (H / 28)(W / 28) tokens (Qwen3-VL: 32 px), and
    <|vision_start|> and <|vision_end|> around them; the default image is the largest square the processor's
    default max_pixels (28 * 28 * 1280) lets through: 980 px (Qwen3-VL: 992)."""
    from memplan.model import sources
    from memplan.model.hf import IMAGE_SIZE_KEY

    q7 = sources.resolve("qwen2.5-vl-7b").config
    q3 = json.loads(QWEN3_VL.read_text())
    assert tasks.task_of(q7) == tasks.task_of(q3) == tasks.IMAGE_TEXT
    assert tasks.image_side(q7) == 980 and tasks.image_side(q3) == 992
    assert tasks.image_text_tokens(q7) == 35 * 35 and tasks.image_span(q7) == 35 * 35 + 2
    assert tasks.image_text_tokens({**q7, IMAGE_SIZE_KEY: [168, 224]}) == 6 * 8
    assert tasks.image_text_tokens({**q3, IMAGE_SIZE_KEY: [128, 192]}) == 4 * 6
    assert tasks.check_image_size(q7, None) == (980, 980) and tasks.check_image_size(q7, (448, 644)) == (448, 644)
    assert tasks.parse_image_size("448") == (448, 448) and tasks.parse_image_size(" 448X644 ") == (448, 644)
    assert tasks.parse_image_size((28, 56)) == (28, 56) and tasks.parse_image_size(None) is None
    with pytest.raises(ConfigError, match="so 450 is not fed; 448 or 476"):
        tasks.check_image_size(q7, (448, 450))
    with pytest.raises(ConfigError, match="multiples of 32 px"):
        tasks.check_image_size(q3, (448, 440))
    assert tasks.stacks(q7) == 32 + 28
    assert tasks.check_images({**q7, IMAGE_SIZE_KEY: [56, 56]}, 2, 13) == 2  # a first token, 2 x (4 + 2) tokens
    with pytest.raises(ConfigError, match="or a smaller --image-size"):
        tasks.check_images({**q7, IMAGE_SIZE_KEY: [56, 56]}, 2, 12)


def test_a_qwen_vl_step_takes_its_inputs_as_the_processor_makes_them():
    """The text holds each image as <|vision_start|>, its image tokens and <|vision_end|> after a first token; the
    image tokens are mm_token_type_ids 1; the pixels are the images' flattened patches (channels x temporal patch x
    patch x patch each) and image_grid_thw (1, H / 14, W / 14) per image."""
    torch = pytest.importorskip("torch")
    from memplan.model.hf import IMAGE_SIZE_KEY, IMAGES_KEY

    cfg = {**json.loads(QWEN25_VL.read_text()), IMAGE_SIZE_KEY: [168, 224], IMAGES_KEY: 2}
    ids = torch.zeros(3, 128, dtype=torch.long)
    out = tasks.step_inputs(tasks.IMAGE_TEXT, cfg, ids, torch.bfloat16)
    row = out["input_ids"][0].tolist()
    assert out["input_ids"].shape == (3, 128) and out["labels"] is out["input_ids"]
    assert row[1] == 2003 and row[2:50] == [2001] * 48 and row[50] == 2004 and row[51] == 2003 and row[100] == 2004
    assert out["mm_token_type_ids"].sum().item() == 3 * 2 * 48
    assert out["pixel_values"].shape == (3 * 2 * 12 * 16, 3 * 2 * 14 * 14)
    assert out["pixel_values"].dtype == torch.bfloat16
    assert out["image_grid_thw"].tolist() == [[1, 12, 16]] * 6
    text = tasks.step_inputs(tasks.IMAGE_TEXT, {**cfg, IMAGES_KEY: 0}, ids, torch.bfloat16)
    assert "pixel_values" not in text and text["mm_token_type_ids"].sum().item() == 0


def test_a_qwen_vl_step_runs_the_same_operations_at_any_micro_batch():
    """Each image's (and window's) attention is a call of its own in the model; the trace runs each segment slot
    once for every image (tracing/grids.py), so micro-batches 2 and 4 run the same operations and their bytes are
    lines in the micro-batch; the constants' limit and the model's functions are restored after the step."""
    pytest.importorskip("torch")
    import torch._subclasses.fake_tensor as ft
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as mq

    from memplan.activations.kernels import Target
    from memplan.activations.tracing.step import one_step
    from memplan.model.hf import IMAGE_SIZE_KEY

    cfg = {**json.loads(QWEN25_VL.read_text()), IMAGE_SIZE_KEY: [168, 224]}
    limit, window, attention = ft.CONSTANT_NUMEL_LIMIT, mq.get_vision_window_index, mq.Qwen2_5_VLVisionAttention.forward
    a, b = (one_step(cfg, n, 128, "deepspeed-bf16", "flash", "none", Target(device="cuda")) for n in (2, 4))
    assert len(a["forward"]) == len(b["forward"]) and len(a["backward"]) == len(b["backward"])
    assert max(b["forward"]) > max(a["forward"])
    assert ft.CONSTANT_NUMEL_LIMIT == limit and mq.get_vision_window_index is window
    assert mq.Qwen2_5_VLVisionAttention.forward is attention


def test_a_segment_slot_is_what_each_image_repeats():
    from memplan.activations.tracing.grids import segment_period

    assert segment_period([64, 48, 64, 48]) == 2 and segment_period([16] * 9) == 1 and segment_period([16, 12, 9]) == 3


def test_qwen_vl_freezes_its_tower_less_the_merger():
    """--freeze vision: the patch embedding and the blocks (and Qwen3-VL's position embedding), the mergers train,
    as Qwen's own fine-tuning script does by default."""
    from memplan.model import freeze

    assert freeze.paths("vision", {"model_type": "qwen2_5_vl"}) == ("model.visual.patch_embed", "model.visual.blocks")
    assert freeze.paths("vision,model.visual.blocks", {"model_type": "qwen3_vl"}) == (
        "model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks")


def test_fsdp2_casts_each_block_s_floating_inputs():
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16) casts every fully_shard'ed module's floating inputs
    (cast_forward_inputs, on by default). Qwen2.5-VL's vision blocks are given the rotary cos and sin in fp32
    [384 x 32] (2 images of 12 x 16 patches): each of the 4 blocks gets bf16 copies, upcasts them (.float()) and
    saves its own fp32 copies for backward, 2 x 384 x 32 x 4 B = 98,304 B a block, where the uncast step saves the
    one shared pair: 3 x 98,304 = 294,912 B more after the forward. LLaVA's blocks get bf16 only: no change.
    options.resolve asks for it under FSDP2 with fsdp-bf16, and feeds an image's pixels in fp32 (model.dtype)."""
    pytest.importorskip("torch")
    from memplan.activations.kernels import Target
    from memplan.activations.tracing.step import one_step
    from memplan.model.hf import BLOCK_INPUT_CAST_KEY, IMAGE_SIZE_KEY

    cfg = {**json.loads(QWEN25_VL.read_text()), IMAGE_SIZE_KEY: [168, 224]}
    a, b = (one_step(c, 2, 128, "deepspeed-bf16", "flash", "none", Target(device="cuda"))
            for c in (cfg, {**cfg, BLOCK_INPUT_CAST_KEY: "bfloat16"}))
    assert b["live"] - a["live"] == 3 * 2 * 384 * 32 * 4 == 294_912
    llava = json.loads(LLAVA.read_text())
    x, y = (one_step(c, 2, 128, "deepspeed-bf16", "flash", "none", Target(device="cuda"))
            for c in (llava, {**llava, BLOCK_INPUT_CAST_KEY: "bfloat16"}))
    assert x["live"] == y["live"]


def test_fsdp_bf16_feeds_pixels_in_fp32_and_fsdp2_casts_block_inputs(monkeypatch):
    """The config the step is traced with: FSDP's bf16 recipe feeds the pixels in fp32 (model.dtype: the fp32
    shards), and FSDP2 (not FSDP1, whose MixedPrecision casts the root's inputs only) casts each block's inputs;
    DDP neither."""
    from memplan import options
    from memplan.activations import profile_cache
    from memplan.model import sources
    from memplan.model.hf import BLOCK_INPUT_CAST_KEY, INPUT_DTYPE_KEY

    from memplan.activations.profile import TracedProfile

    seen: list[dict] = []

    def traced(config, **kw):  # a profile whose blocks were given fp32 tensors (Qwen-VL's vision cos and sin)
        seen.append(config)
        return TracedProfile({"block_float_inputs": ["bfloat16", "float32"]}, 1, "test")

    monkeypatch.setattr(profile_cache, "load_or_trace", traced)
    src = sources.resolve(str(QWEN25_VL))
    inv = sources.build_inventory(src)
    for strategy, version in (("fsdp-full", 2), ("fsdp-full", 1), ("ddp", 2)):
        seen.clear()
        try:
            options.resolve(inv, JobRequest.of(gpus=2, strategy=strategy, fsdp_version=version, seq_len=128,
                                               image_size=(168, 224)), config=src.config)
        except Exception:  # noqa: BLE001 (the profile is not there: the config asked for is what is looked at)
            pass
        assert seen, strategy
        assert all(c.get(INPUT_DTYPE_KEY) == (None if strategy == "ddp" else "float32") for c in seen)
        # FSDP2: the profile's blocks took fp32, so the step is traced again with each unit's inputs cast
        assert [c.get(BLOCK_INPUT_CAST_KEY) for c in seen] == (
            [None, "bfloat16"] if (strategy, version) == ("fsdp-full", 2) else [None])


def test_every_shipped_preset_s_blocks_take_bf16_alone():
    """The shipped profiles were traced before the record of the blocks' floating inputs; options reads a missing
    record as bf16 alone (FSDP2's cast of each unit's inputs then copies nothing). That holds for every preset
    but the Qwen-VL ones (traced with the record): each is traced here in bf16 at 2 blocks (the vision-language
    ones as their tiny configs of the same classes), its blocks given bf16 tensors only."""
    pytest.importorskip("torch")
    from memplan.activations.kernels import Target
    from memplan.activations.tracing.step import one_step
    from memplan.model import sources, tasks as T
    from memplan.model.scaling import scale_config

    configs = {}
    for name in sources.preset_names():
        cfg = sources.resolve(name).config
        if T.task_of(cfg) == T.IMAGE_TEXT:
            continue
        configs[name] = scale_config(cfg, layers=2, hidden=256, vocab=2048)[0]
    for path in (LLAVA, GEMMA3_VL, PALIGEMMA):
        configs[path.name] = json.loads(path.read_text())
    for name, cfg in configs.items():
        r = one_step(cfg, 2, 64, "deepspeed-bf16", "flash", "none", Target(device="cuda"))
        assert r["block_float_inputs"] in ([], ["bfloat16"]), name
    q = {**json.loads(QWEN25_VL.read_text()), "memplan_image_size": [56, 56]}
    assert one_step(q, 2, 64, "deepspeed-bf16", "flash", "none", Target(device="cuda"))["block_float_inputs"] == [
        "bfloat16", "float32"]


def test_the_json_schema_names_every_task():
    schema = json.loads((Path(__file__).resolve().parents[2] / "memplan" / "schema" / "estimate-v1.schema.json")
                        .read_text())
    assert set(schema["properties"]["model"]["properties"]["task"]["enum"]) == set(tasks.TASKS)


def test_a_profile_without_the_block_inputs_record_is_bf16_alone_only_when_shipped():
    """The shipped profiles predate the record (their presets' blocks take bf16 alone: tested above); a profile
    cached before it is not known, and FSDP2's cast is traced for it."""
    from memplan.activations.profile import TracedProfile
    from memplan.options import other_block_inputs

    assert not other_block_inputs(TracedProfile({}, 1, "shipped"))
    assert not other_block_inputs(TracedProfile({}, 1, "shipped traces at seq 1024, 2048, 4096"))
    assert other_block_inputs(TracedProfile({}, 1, "cache"))
    assert other_block_inputs(TracedProfile({}, 1, "shipped and cached traces at seq 1024, 2048, 4096"))
    assert not other_block_inputs(TracedProfile({"block_float_inputs": ["bfloat16"]}, 1, "cache"))
    assert other_block_inputs(TracedProfile({"block_float_inputs": ["bfloat16", "float32"]}, 1, "shipped"))


def test_a_causal_lm_without_sdpa_traces_transformers_eager_attention():
    """Gemma 2 (soft-capped logits) has no SDPA attention in transformers 5 (_supports_sdpa False): a job that names
    no attn_implementation runs it eager (modeling_utils.py get_correct_attn_implementation), and so do the trace
    and the harness, instead of the trace failing and the estimate falling back to the analytic formula."""
    pytest.importorskip("torch")
    import torch
    from transformers import AutoConfig

    from memplan import options
    from memplan.model import sources
    from memplan.model.hf import transformers_config

    cfg = dict(AutoConfig.for_model("gemma2").to_dict(), architectures=["Gemma2ForCausalLM"], num_hidden_layers=2,
               hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
               vocab_size=256, layer_types=["sliding_attention", "full_attention"])
    cfg.pop("transformers_version", None)
    llama = dict(AutoConfig.for_model("llama").to_dict(), architectures=["LlamaForCausalLM"])
    assert not tasks.sdpa_supported(cfg) and tasks.sdpa_supported(llama)
    with torch.device("meta"):
        model = tasks.build(cfg, transformers_config(cfg), attn_implementation="sdpa")
    assert model.config._attn_implementation == "eager"
    src = sources.ModelSource(name="gemma2", kind="config", config=cfg, description="test")
    inv = sources.build_inventory(src)
    r = options.resolve(inv, JobRequest.of(gpus=1, seq_len=64, device="cuda"), config=cfg)
    assert type(r.settings.activation_profile).__name__ == "TracedProfile"
    assert any(n.startswith("attention: eager, as transformers runs it") for n in r.notes)


def test_a_config_its_class_refuses_is_not_called_unknown():
    """A known model_type whose fields fail its config class's own checks says so, not 'does not know'."""
    pytest.importorskip("transformers")
    from memplan.model.hf import transformers_config

    with pytest.raises(ConfigError, match="is not valid for gemma4_text"):
        transformers_config({"model_type": "gemma4_text", "num_hidden_layers": 2, "per_layer_config": {"05": {}}})
    with pytest.raises(ConfigError, match="does not know model_type"):
        transformers_config({"model_type": "no_such_model_type"})


def test_a_vision_language_model_type_s_text_only_class_has_no_tower():
    """MllamaForCausalLM is model_type mllama without the vision model: --freeze vision says it has none."""
    from memplan.model import freeze

    cfg = {**json.loads(MLLAMA.read_text()), "architectures": ["MllamaForCausalLM"]}
    assert tasks.task_of(cfg) == tasks.CAUSAL_LM
    with pytest.raises(ConfigError, match="this model has none"):
        freeze.paths("vision", cfg)


QWEN35 = Path(__file__).resolve().parents[1] / "data" / "configs" / "qwen3.5-tiny.json"


def test_a_composite_config_s_causal_lm_is_its_language_model():
    """AutoModelForCausalLM on a Qwen3.5 config.json builds Qwen3_5ForCausalLM from its text_config
    (auto_factory.py); memplan builds, traces and runs the same: the text config, flat, with that class."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memplan.model import sources

    cfg = json.loads(QWEN35.read_text())
    assert tasks.task_of(cfg) == tasks.IMAGE_TEXT  # its own class trains on images too (a patch-grid model)
    src = sources.with_task(sources.resolve(str(QWEN35)), "causal-lm")
    assert src.config["model_type"] == "qwen3_5_text" and src.config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert "text_config" not in src.config and src.config["dtype"] == "bfloat16"
    inv = sources.build_inventory(src)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert inv.num_params == sum(p.numel() for p in model.parameters()) == 924_984
    assert any("built from the config's text_config" in n for n in inv.notes)
    # a config naming the causal class itself needs no --task; a flat config is left as it is
    named = {**cfg, "architectures": ["Qwen3_5ForCausalLM"]}
    assert tasks.language_model(named)[0] == src.config
    assert tasks.language_model(src.config) is None
    assert tasks.language_model(json.loads(LLAVA.read_text())) is None


GEMMA3_VL = Path(__file__).resolve().parents[1] / "data" / "configs" / "gemma3-vl-tiny.json"


def test_deberta_v2_classification_traces_its_label_nonzero():
    """DeBERTa-v2's classification loss indexes the labels that are not negative ((labels >= 0).nonzero()): the
    step's labels are made from a list, so the trace keeps their values and nonzero its size
    (tracing/grids.py reads_ids). Its pooler_hidden_size follows --hidden (scaling.scale_config)."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    from memplan.activations.kernels import Target
    from memplan.activations.tracing.step import one_step
    from memplan.model.scaling import scale_config

    cfg = {**AutoConfig.for_model("deberta-v2").to_dict(), "architectures": ["DebertaV2ForSequenceClassification"]}
    cfg.pop("transformers_version", None)
    small, changes = scale_config(cfg, layers=2, hidden=128, vocab=512)
    assert small["pooler_hidden_size"] == 128 and "pooler_hidden_size 1536 -> 128" in changes
    out = one_step(small, 2, 64, "torch-amp", "sdpa", "none", Target(device="cuda", arch="sm90"))
    assert max(out["forward"]) > 0


def test_a_vision_language_config_under_a_classification_head_trains_its_text_alone(tmp_path):
    """Gemma3ForSequenceClassification is GenericForSequenceClassification over Gemma3Model, vision tower
    included: two stacks traced at full depth, and the tower, which text alone never runs, gets no gradient (the
    traced step's unreached parameters)."""
    pytest.importorskip("transformers")
    from memplan import options
    from memplan.model.sources import build_inventory, resolve

    cfg = {**json.loads(GEMMA3_VL.read_text()), "architectures": ["Gemma3ForSequenceClassification"]}
    assert tasks.task_of(cfg) == "sequence-classification" and tasks.two_stacks(cfg)
    assert tasks.stacks(cfg) == cfg["vision_config"]["num_hidden_layers"] + cfg["text_config"]["num_hidden_layers"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    src = resolve(str(path))
    inv = build_inventory(src)
    r = options.resolve(inv, JobRequest.of(device="cpu", micro_batch=2, seq_len=64, precision="fp32"),
                        config=src.config)
    tower = {t.name for t in inv.tensors if t.name.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
    assert tower and set(r.settings.unreached) == tower


def test_a_bart_style_classifier_s_sequences_end_with_their_eos():
    """BartForSequenceClassification pools each sequence's last EOS and refuses examples without one: the step's
    token ids end with the config's eos_token_id and hold no other."""
    import torch

    cfg = {"model_type": "mbart", "architectures": ["MBartForSequenceClassification"], "eos_token_id": 2}
    ids = torch.full((2, 8), 2, dtype=torch.long)
    got = tasks.step_inputs("sequence-classification", cfg, ids)["input_ids"]
    assert (got[:, -1] == 2).all() and (got[:, :-1] != 2).all() and (got == 2).sum(1).tolist() == [1, 1]


def test_an_encoder_decoder_classifier_is_two_stacks_and_its_shared_embedding_comes_late(tmp_path):
    """BartForSequenceClassification and T5ForSequenceClassification run both stacks and pool the decoder's output
    at each sequence's last EOS (read from the step's ids, kept as values): two stacks traced at full depth. Their
    shared embedding is tied to the two stacks' embeddings, not to a head: its gradient's first contribution is
    the decoder's embedding's backward, after the decoder's blocks, so it is counted inside the encoder's blocks'
    backward, not the decoder's (layouts.tied_to_head; the CPU harness: MBart +1.93% -> -0.13%)."""
    pytest.importorskip("transformers")
    from memplan import layouts, strategies
    from memplan.model.sources import build_inventory, resolve

    bart = {**json.loads(BART.read_text()), "architectures": ["BartForSequenceClassification"]}
    assert tasks.encoder_decoder_head(bart) and tasks.two_stacks(bart)
    assert tasks.stacks(bart) == bart["encoder_layers"] + bart["decoder_layers"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(bart))
    inv = build_inventory(resolve(str(path)))
    (shared,) = [t for t in inv.tensors if t.tied_names]
    assert not layouts.tied_to_head(shared)
    g = layouts.gather_sizes(inv, strategies.PER_PARAM_DIM0, 1)
    assert g.root_between >= shared.numel and g.root_head < shared.numel


def test_a_vision_language_model_memplan_does_not_trace_says_what_to_do():
    """Llama 4's ForConditionalGeneration is refused by name, with --task causal-lm for its language model alone
    (Llama4ForCausalLM, as AutoModelForCausalLM builds it)."""
    pytest.importorskip("transformers")
    cfg = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
           "text_config": {"model_type": "llama4_text"}, "vision_config": {"model_type": "llama4_vision_model"}}
    with pytest.raises(ConfigError, match=r"--task causal-lm trains its language model alone \(Llama4ForCausalLM"):
        tasks.task_of(cfg)


def test_qwen3_5_trains_on_its_images_as_qwen3_vl_does():
    """Qwen3.5 (and its MoE) build Qwen3-VL's vision tower and 3-D positions from vision_utils and
    get_rope_index (modeling_qwen3_5.py): a patch-grid model, its image tokens (H/32)(W/32) between its vision
    start and end; --freeze vision freezes the tower less its merger. CPU harness (`memplan validate
    qwen3.5-tiny.json --micro-batch 2 --seq-len 128 --image-size 64x64 --device cpu --gpus 1`): fp32 -0.01%,
    torch-amp -0.01%, the MoE's fp32 -0.01%, model states exact."""
    cfg = json.loads(QWEN35.read_text())
    assert cfg["model_type"] in tasks.PATCH_GRID_MODELS
    from memplan.model import freeze

    assert freeze.paths("vision", cfg) == ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks")


def test_a_span_head_named_simple_is_question_answering_not_a_causal_lm():
    """XLM's and FlauBERT's ForQuestionAnsweringSimple is their span head (transformers' question-answering
    mapping): it was taken as a causal LM by its name, and the LM head's model built in its place. CPU harness
    (FlauBERT, 2 blocks, hidden 256): -0.01%."""
    cfg = {"architectures": ["FlaubertForQuestionAnsweringSimple"], "model_type": "flaubert"}
    assert tasks.task_of(cfg) == "question-answering"


LONGFORMER = Path(__file__).resolve().parents[1] / "data" / "configs" / "longformer-base-4096.json"
LED = Path(__file__).resolve().parents[1] / "data" / "configs" / "led-base-16384.json"


def test_longformer_and_led_read_their_attention_mask_and_trace():
    """Longformer's and LED's encoders ask whether any token attends globally (``.any().item()`` of the mask) and
    gather the global tokens' indices (nonzero): the step is fed a tokenizer's mask of ones, kept as values
    (tracing/grids.py reads_mask). A sequence classifier puts its CLS token in global attention (its global path
    traced too); the per-layer attention_window lists follow --layers (scaling.per_layer_keys)."""
    pytest.importorskip("transformers")
    import torch

    from memplan.activations.kernels import Target
    from memplan.activations.tracing.step import one_step
    from memplan.model.scaling import scale_config

    base = json.loads(LONGFORMER.read_text())
    got = tasks.step_inputs("masked-lm", base, torch.zeros(2, 8, dtype=torch.long))
    assert got["attention_mask"].tolist() == [[1] * 8] * 2
    assert "attention_mask" not in tasks.step_inputs("masked-lm", {"model_type": "bert"},
                                                      torch.zeros(2, 8, dtype=torch.long))
    small, changes = scale_config(base, layers=2, hidden=128, vocab=512)
    assert small["attention_window"] == [512, 512] and "num_hidden_layers 12 -> 2" in changes
    for cfg in (small, {**small, "architectures": ["LongformerForSequenceClassification"]}):
        out = one_step(cfg, 2, 1024, "fp32", "sdpa", "none", Target(device="cpu"))
        assert max(out["forward"]) > 0
    led, changes = scale_config(json.loads(LED.read_text()), layers=2, hidden=128, vocab=512)
    assert led["attention_window"] == [1024, 1024] and changes[:2] == ["encoder_layers 6 -> 2", "decoder_layers 6 -> 2"]
    from memplan.model.hf import TARGET_KEY

    out = one_step({**led, TARGET_KEY: 16}, 2, 1024, "torch-amp", "sdpa", "none", Target(device="cuda", arch="sm90"))
    assert max(out["forward"]) > 0
