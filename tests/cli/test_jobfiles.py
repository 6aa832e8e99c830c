"""The job's own files (memplan/jobfiles.py: Accelerate configs, TrainingArguments) and `memplan check`, the CI
gate; the example files README's GitHub Actions step and pre-commit hook use are run here as written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bad_inputs import run_cli

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples" / "ci"
#: the commands README shows (GitHub Actions, pre-commit), run from the repository root
README_COMMANDS = [
    "memplan check llama-3-8b --training-args examples/ci/train_args.json --gpus 8 --gpu h100-80g --max-fraction 0.9",
    "memplan check llama-3-8b --accelerate-config examples/ci/accelerate_fsdp.yaml --training-args "
    "examples/ci/train_args_fsdp.yaml --gpu h100-80g --max-fraction 0.9",
]


def _json(args: list[str]) -> tuple[int, dict]:
    code, out, err = run_cli(args + ["--json"])
    assert code in (0, 1), err
    return code, json.loads(out)


@pytest.mark.parametrize("command", README_COMMANDS)
def test_the_readme_ci_commands_pass_on_their_example_files(command, monkeypatch):
    monkeypatch.chdir(ROOT)
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert command in readme
    code, out, _ = run_cli(command.split()[1:])
    assert code == 0 and out.startswith("PASS llama-3-8b: needs ") and out.count("\n") == 1


def test_training_args_with_a_deepspeed_file_fill_its_autos(monkeypatch):
    monkeypatch.chdir(ROOT)
    code, rep = _json("estimate llama-3-8b --gpus 8 --training-args examples/ci/train_args.json".split())
    st, src = rep["strategy"], rep["assumptions"]["setting_sources"]
    assert (st["name"], st["micro_batch"], st["grad_accum"], st["recompute"], st["precision"]) == \
        ("zero3", 4, 8, "full", "deepspeed-bf16")
    assert st["deepspeed"]["reduce_bucket_size"] == 4096 * 4096  # "auto": hidden_size^2 (HF Trainer)
    assert src["micro_batch"] == src["precision"] == "examples/ci/train_args.json"
    assert src["strategy"].endswith("ds_zero3.json")


def test_an_accelerate_fsdp_config_and_training_args(monkeypatch):
    monkeypatch.chdir(ROOT)
    args = ("estimate llama-3-8b --accelerate-config examples/ci/accelerate_fsdp.yaml --training-args "
            "examples/ci/train_args_fsdp.yaml").split()
    code, rep = _json(args)
    st, cl = rep["strategy"], rep["cluster"]
    assert (st["name"], st["torch"]["fsdp_version"], cl["gpus"], cl["gpus_per_node"]) == ("fsdp-full", 2, 8, 8)
    assert (st["micro_batch"], st["grad_accum"], st["recompute"], st["precision"]) == (2, 16, "full", "fsdp-bf16")
    assert any("reduces in bf16" in n for n in rep["notes"])
    # the command line wins, and says so
    code, over = _json(args + ["--micro-batch", "1", "--gpus", "16"])
    assert over["strategy"]["micro_batch"] == 1 and over["cluster"]["gpus"] == 16
    assert any(n.startswith("micro_batch: command line 1 overrides examples/ci/train_args_fsdp.yaml 2")
               for n in over["notes"])
    assert over["assumptions"]["setting_sources"]["micro_batch"] == "command line"


def _write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_accelerate_deepspeed_plugin_and_defaults(tmp_path):
    acc = _write(tmp_path, "acc.yaml", "distributed_type: DEEPSPEED\nmixed_precision: fp16\nnum_processes: 16\n"
                 "num_machines: 2\ndeepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\n"
                 "  gradient_accumulation_steps: 4\n")
    code, rep = _json(["estimate", "llama-7b", "--accelerate-config", acc])
    st = rep["strategy"]
    assert (st["name"], st["precision"], st["grad_accum"], rep["cluster"]["gpus_per_node"]) == \
        ("zero3", "deepspeed-fp16", 4, 8)
    assert st["deepspeed"]["offload_optimizer"] is True
    # TrainingArguments without a batch size: transformers' default, 8 per device
    ta = _write(tmp_path, "ta.json", '{"output_dir": "x"}')
    code, rep = _json(["estimate", "llama-7b", "--gpus", "2", "--training-args", ta])
    # llama-7b's config stores float16, which transformers 5 loads it in: no mixed precision trains it there
    assert rep["strategy"]["micro_batch"] == 8 and rep["strategy"]["precision"] == "pure-bf16"


def test_optimizer_names(tmp_path):
    for optim, want in (("adamw_torch", ("adamw", "foreach")), ("paged_adamw_8bit", ("paged_adamw_8bit", "fused")),
                        ("paged_adamw_32bit", ("paged_adamw_32bit", "fused")), ("adamw_bnb_8bit", ("adam8bit", "fused")),
                        ("adafactor", ("adafactor", None))):
        ta = _write(tmp_path, f"{optim}.json", json.dumps({"optim": optim, "per_device_train_batch_size": 1}))
        code, rep = _json(["estimate", "llama-7b", "--gpus", "2", "--training-args", ta])
        assert rep["strategy"]["optimizer"] == want[0]
        if want[1]:
            assert rep["assumptions"]["optimizer_impl"] == want[1]
    code, out, err = run_cli(["estimate", "llama-7b", "--training-args",
                              _write(tmp_path, "lion.json", '{"optim": "lion_8bit"}')])
    assert code == 2 and "lion_8bit" in err and "not modelled" in err and err.count("\n") == 1
    code, out, err = run_cli(["estimate", "llama-7b", "--training-args",
                              _write(tmp_path, "bad.json", '{"optim": "adamw_turbo"}')])
    assert code == 2 and "not an optimizer transformers accepts" in err


@pytest.mark.parametrize("name,text,needle", [
    ("bad.yaml", "distributed_type: FSDP\n  num_processes: [8\n", "not valid YAML at line"),
    ("bad.json", '{"bf16": true,,}', "not valid JSON"),
    ("list.yaml", "- 1\n- 2\n", "must hold a mapping"),
    ("fp8.yaml", "distributed_type: MULTI_GPU\nmixed_precision: fp8\nfp8_config:\n  backend: TE\n",
     "Transformer Engine's and MS-AMP's float8 are not modelled"),
    ("fp8ds.yaml", "distributed_type: DEEPSPEED\nmixed_precision: fp8\n", "fp8 under DeepSpeed"),
    ("fp8fsdp1.yaml", "distributed_type: FSDP\nmixed_precision: fp8\nnum_processes: 2\n", "not under DeepSpeed, Horovod or FSDP1"),
    ("tpu.yaml", "distributed_type: XLA\n", "not modelled"),
    ("zero2h.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD_ZERO2\n",
     "not modelled"),
    ("procs.yaml", "distributed_type: MULTI_GPU\nnum_processes: 6\nnum_machines: 4\n", "not a multiple"),
])
def test_bad_accelerate_configs(tmp_path, name, text, needle):
    code, out, err = run_cli(["estimate", "llama-7b", "--accelerate-config", _write(tmp_path, name, text)])
    assert code == 2 and needle in err and err.count("\n") == 1 and out == ""


def test_training_args_the_trainer_refuses(tmp_path):
    ds = _write(tmp_path, "ds.json", '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}')
    ta = _write(tmp_path, "ta.json", json.dumps({"per_device_train_batch_size": 4, "deepspeed": ds}))
    code, out, err = run_cli(["estimate", "llama-7b", "--gpus", "8", "--training-args", ta])
    assert code == 2 and "mismatch" in err
    ta = _write(tmp_path, "v2.json", json.dumps({"fsdp": "hybrid_shard auto_wrap", "bf16": True}))
    code, out, err = run_cli(["estimate", "llama-7b", "--gpus", "8", "--training-args", ta])
    assert code == 2 and "only available with FSDP1" in err


def test_check_fails_with_the_cheapest_fix_and_json(tmp_path):
    code, out, _ = run_cli("check llama-3-8b --gpus 8 --strategy ddp --gpu h100-80g".split())
    assert code == 1 and out.startswith("FAIL llama-3-8b: needs ") and "cheapest change that fits: --strategy" in out
    code, rep = _json("check llama-3-8b --gpus 8 --stage 2 --gpu h100-80g --max-fraction 0.6".split())
    chk = rep["check"]
    assert code == 1 and chk["pass"] is False and chk["limit_bytes"] == int(0.6 * chk["gpu_memory_bytes"])
    assert chk["required_bytes"] == rep["estimate"]["per_gpu"]["required_bytes"] > chk["limit_bytes"]
    assert "--stage 3" in chk["line"]  # ZeRO-3 fits within 60% of the card (its reserved peak: 51%)
    code, out, err = run_cli("check llama-3-8b --gpus 8".split())
    assert code == 2 and "check needs the GPU" in err
    code, out, err = run_cli("check llama-3-8b --gpu h100-80g --max-fraction 1.5".split())
    assert code == 2 and "--max-fraction" in err


def test_accelerate_fsdp2_no_wrap_is_root_only(tmp_path):
    # Accelerate's fsdp2_prepare_model with fsdp_auto_wrap_policy NO_WRAP fully_shards only the model
    acc = _write(tmp_path, "acc.yaml", "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 8\n"
                                       "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: NO_WRAP\n")
    code, rep = _json(["estimate", "llama-7b", "--accelerate-config", acc])
    assert rep["strategy"]["torch"]["fsdp_wrap"] == "none"
    code, block = _json(["estimate", "llama-7b", "--gpus", "8", "--strategy", "fsdp-full"])
    assert rep["per_gpu"]["peak_bytes"] > block["per_gpu"]["peak_bytes"]
    # no fsdp_auto_wrap_policy at all: accelerate's plugin defaults to NO_WRAP (FSDP_AUTO_WRAP_POLICY unset), for
    # FSDP1 too; the Trainer's fsdp_config defaults to TRANSFORMER_BASED_WRAP
    for version, wrap in ((2, "none"), (1, "none")):
        acc = _write(tmp_path, f"acc{version}.yaml", "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 8\n"
                                                     f"fsdp_config:\n  fsdp_version: {version}\n")
        code, rep = _json(["estimate", "llama-7b", "--accelerate-config", acc, "--activations", "analytic"])
        assert rep["strategy"]["torch"]["fsdp_wrap"] == wrap
    ta = _write(tmp_path, "ta.json", json.dumps({"fsdp": "full_shard", "bf16": True}))
    code, rep = _json(["estimate", "llama-7b", "--gpus", "8", "--training-args", ta, "--activations", "analytic"])
    assert rep["strategy"]["torch"]["fsdp_wrap"] == "block+embeddings"  # FSDP2 through Accelerate, untied


def test_accelerate_fsdp2_transformer_wrap_units(tmp_path):
    # Accelerate 1.15's fsdp2_prepare_model: the decoder layers, the input embedding and [final norm, head] are
    # units (--fsdp-wrap block+embeddings); a tied embedding joins the head's unit, which then behaves as the root
    acc = _write(tmp_path, "acc.yaml", "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 8\n"
                                       "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n")
    code, rep = _json(["estimate", "llama-7b", "--accelerate-config", acc])
    assert rep["strategy"]["torch"]["fsdp_wrap"] == "block+embeddings"
    assert any("block+embeddings" in n for n in rep["notes"])
    assert rep["reserved"]["method"] == "replayed"
    code, rep = _json(["estimate", "gpt2", "--accelerate-config", acc])
    assert rep["strategy"]["torch"]["fsdp_wrap"] == "block"
    assert any("tied input embedding" in n for n in rep["notes"])
    # the job file's marker is not a command-line value
    code, out, err = run_cli("estimate llama-7b --gpus 8 --strategy fsdp-full --fsdp-wrap accelerate-fsdp2".split())
    assert code == 2 and "--fsdp-wrap must be one of" in err and len(err.strip().splitlines()) == 1


def test_accelerate_size_based_wrap(tmp_path):
    # FSDP1: FullyShardedDataParallelPlugin wraps with size_based_auto_wrap_policy(min_num_params) when it is above
    # zero; the launcher's default is int(1e8) (commands/launch.py --fsdp_min_num_params)
    head = "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 8\nfsdp_config:\n"
    acc = _write(tmp_path, "a1.yaml", head + "  fsdp_version: 1\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n")
    code, rep = _json(["estimate", "llama-3-8b", "--accelerate-config", acc, "--activations", "analytic"])
    assert rep["strategy"]["torch"]["fsdp_wrap"] == "size:100000000"
    acc = _write(tmp_path, "a2.yaml", head + "  fsdp_version: 1\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n"
                                             "  fsdp_min_num_params: 0\n")
    code, rep = _json(["estimate", "llama-3-8b", "--accelerate-config", acc, "--activations", "analytic"])
    assert rep["strategy"]["torch"]["fsdp_wrap"] == "none"  # zero: no policy ("silently ignored")
    # FSDP2: Accelerate 1.15 fully_shards every module above min_num_params, the decoder's nn.ModuleList too,
    # which fully_shard refuses: the job fails in prepare
    acc = _write(tmp_path, "a3.yaml", head + "  fsdp_version: 2\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n")
    code, out, err = run_cli(["estimate", "llama-3-8b", "--accelerate-config", acc])
    assert code == 2 and "model.layers" in err and "fully_shard" in err and len(err.strip().splitlines()) == 1
    # an unknown policy is one line too
    acc = _write(tmp_path, "a4.yaml", head + "  fsdp_version: 1\n  fsdp_auto_wrap_policy: LAMBDA_WRAP\n")
    code, out, err = run_cli(["estimate", "llama-3-8b", "--accelerate-config", acc])
    assert code == 2 and "LAMBDA_WRAP" in err and len(err.strip().splitlines()) == 1


def test_size_wrap_on_the_command_line():
    # llama-3-8b at 1e8: the attention of every block goes to the unit around the decoder stack, held through
    # forward and backward; counted in the root group, more than the block-wise units hold
    code, size = _json(["estimate", "llama-3-8b", "--gpus", "8", "--strategy", "fsdp-full", "--fsdp-version", "1",
                        "--fsdp-wrap", "size:1e8", "--activations", "analytic"])
    code, block = _json(["estimate", "llama-3-8b", "--gpus", "8", "--strategy", "fsdp-full", "--fsdp-version", "1",
                         "--activations", "analytic"])
    assert size["strategy"]["torch"]["fsdp_wrap"] == "size:100000000"
    assert size["per_gpu"]["peak_bytes"] > block["per_gpu"]["peak_bytes"]
    for bad in ("size:0", "size:abc"):
        code, out, err = run_cli(["estimate", "llama-3-8b", "--gpus", "8", "--strategy", "fsdp-full",
                                  "--fsdp-wrap", bad])
        assert code == 2 and "size:N" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli("estimate llama-3-8b --gpus 8 --stage 3 --fsdp-wrap size:1e8".split())
    assert code == 2 and "is for FSDP" in err


def test_wrap_classes(tmp_path):
    # fsdp_transformer_layer_cls_to_wrap (Accelerate's comma-separated string): the decoder layer's class is the
    # block-wise wrap; another class makes those modules the units; a class the model lacks is Accelerate's error
    head = "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 8\nfsdp_config:\n"
    pol = "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
    acc = _write(tmp_path, "c1.yaml", head + "  fsdp_version: 1\n" + pol
                 + "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n")
    code, rep = _json(["estimate", "llama-3-8b", "--accelerate-config", acc, "--activations", "analytic"])
    assert rep["strategy"]["torch"]["fsdp_wrap"] == "block"
    acc = _write(tmp_path, "c2.yaml", head + "  fsdp_version: 1\n" + pol
                 + "  fsdp_transformer_layer_cls_to_wrap: LlamaMLP\n")
    code, rep = _json(["estimate", "llama-3-8b", "--accelerate-config", acc, "--activations", "analytic"])
    assert rep["strategy"]["torch"]["fsdp_wrap"] == "class:LlamaMLP"
    acc = _write(tmp_path, "c3.yaml", head + "  fsdp_version: 2\n" + pol
                 + "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n")
    code, rep = _json(["estimate", "llama-3-8b", "--accelerate-config", acc, "--activations", "analytic"])
    assert rep["strategy"]["torch"]["fsdp_wrap"] == "block+embeddings"
    acc = _write(tmp_path, "c4.yaml", head + "  fsdp_version: 2\n" + pol
                 + "  fsdp_transformer_layer_cls_to_wrap: GPT2Block\n")
    code, out, err = run_cli(["estimate", "llama-3-8b", "--accelerate-config", acc])
    assert code == 2 and "GPT2Block" in err and "LlamaDecoderLayer" in err and len(err.strip().splitlines()) == 1
    # on the command line too
    code, out, err = run_cli("estimate llama-3-8b --gpus 8 --strategy fsdp-full --fsdp-wrap class:Nope".split())
    assert code == 2 and "Nope" in err and "LlamaMLP" in err
    code, out, err = run_cli("estimate llama-3-8b --gpus 8 --strategy fsdp-full --fsdp-wrap class:".split())
    assert code == 2 and "class:NAME" in err


@pytest.mark.parametrize("model,args,recipe,note", [
    # a bf16 checkpoint with bf16=True: bf16 weights, gradients and states under autocast
    ("llama-3-8b", '{"bf16": true}', "bf16-autocast", "leaves its weights, gradients and AdamW states in bf16"),
    # no mixed precision: the model trains in the dtype it was loaded in
    ("llama-3-8b", '{}', "pure-bf16", "trains it in that dtype"),
    # an fp32 config (gpt2 declares none: fp32): autocast over fp32 weights
    ("gpt2", '{"bf16": true}', "torch-amp", None),
    ("gpt2", '{}', "fp32", None),
    # an fp16 checkpoint under bf16 autocast: every weight copied for its matmuls
    ("llama-7b", '{"bf16": true}', "fp16-bf16-autocast", "copies every float16 weight"),
    ("llama-3-8b", '{"fp16": true}', "fp16-bf16-autocast", "the same bytes"),
    # fp16 on fp16 weights fails in GradScaler: counted as the fp32 load that runs it
    ("llama-7b", '{"fp16": true}', "torch-amp", "Attempting to unscale FP16 gradients"),
])
def test_trainer_precision_follows_the_dtype_transformers_loads(tmp_path, model, args, recipe, note):
    """transformers 5's from_pretrained loads a checkpoint in its config's dtype (dtype='auto'); the Trainer's
    bf16/fp16 autocasts over it without casting the model (measured with the real Trainer on CPU: docs/
    accuracy.md's bf16-autocast rows, session 33's note)."""
    ta = _write(tmp_path, "ta.json", args)
    code, rep = _json(["estimate", model, "--training-args", ta, "--activations", "analytic"])
    assert code == 0 and rep["strategy"]["precision"] == recipe
    notes = [n for n in rep["notes"] if n.startswith("precision:")]
    assert (note is None and not notes) or (note is not None and any(note in n for n in notes)), notes



def test_an_accelerate_config_autocasts_the_model_as_loaded(tmp_path):
    # distributed_type MULTI_GPU with bf16: Accelerate's autocast over the model the script loads (transformers 5:
    # its config's dtype), as the Trainer's bf16
    acc = _write(tmp_path, "acc.yaml", "distributed_type: MULTI_GPU\nmixed_precision: bf16\nnum_processes: 8\n")
    for model, recipe in (("llama-3-8b", "bf16-autocast"), ("gpt2", "torch-amp")):
        code, rep = _json(["estimate", model, "--accelerate-config", acc, "--activations", "analytic"])
        assert rep["strategy"]["precision"] == recipe and rep["cluster"]["gpus"] == 8


def _tiny_llama(tmp_path: Path) -> str:
    """A bf16 llama config small enough to trace in a second (its linears' dims multiples of 16)."""
    return _write(tmp_path, "config.json", json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 512,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False}))


def test_an_accelerate_fp8_config_is_torchaos_float8(tmp_path):
    # mixed_precision fp8 with the torchao backend: Float8Linear (tensorwise) on every nn.Linear but the first and
    # the last (accelerate/utils/ao.py), under Accelerate's bf16 autocast over the model as loaded
    pytest.importorskip("torchao")
    cfg = _tiny_llama(tmp_path)
    acc = _write(tmp_path, "acc.yaml", "distributed_type: MULTI_GPU\nmixed_precision: fp8\nnum_processes: 2\n"
                 "fp8_config:\n  backend: AO\n")
    code, rep = _json(["estimate", cfg, "--accelerate-config", acc, "--seq-len", "128", "--gpu", "h100-80g"])
    st = rep["strategy"]
    assert code == 0 and (st["precision"], st["float8"], st["float8_keep"]) == ("bf16-autocast", "tensorwise",
                                                                                 "first-last")
    # the same job on the command line gives the same bytes
    code, cli = _json(["estimate", cfg, "--gpus", "2", "--strategy", "ddp", "--precision", "bf16-autocast",
                       "--float8", "tensorwise", "--float8-keep", "first-last", "--seq-len", "128", "--gpu",
                       "h100-80g"])
    assert cli["per_gpu"]["peak_bytes"] == rep["per_gpu"]["peak_bytes"]


def test_an_accelerate_fp8_config_under_fsdp2_gathers_in_float8(tmp_path):
    # fp8_config.enable_fsdp_float8_all_gather defaults to True (AORecipeKwargs): FSDP2 gathers the float8 weights
    pytest.importorskip("torchao")
    cfg = _tiny_llama(tmp_path)
    acc = _write(tmp_path, "acc.yaml", "distributed_type: FSDP\nmixed_precision: fp8\nnum_processes: 2\n"
                 "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n")
    code, rep = _json(["estimate", cfg, "--accelerate-config", acc, "--seq-len", "128", "--gpu", "h100-80g"])
    st = rep["strategy"]
    assert code == 0 and st["float8_all_gather"] is True and st["precision"] == "fsdp-bf16"
