"""The command line as a user runs it: exit codes, one-line errors, JSON contract, help, README coverage."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memplan.units import fmt_bytes

ROOT = Path(__file__).resolve().parents[2]


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "memplan", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_estimate_json_schema_v1():
    r = run("estimate", "llama-7b", "--gpus", "8", "--stage", "3", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["schema_version"] == 1
    assert d["model"] == {"name": "llama-2-7b", "source": "preset llama-2-7b (alias llama-7b)",
                          "num_params": 6738415616, "family": "llama", "task": "causal-lm",
                          "buffers_bytes": 1024}  # inv_freq, original_inv_freq: 256 B fp32 each, 512-byte CUDA blocks
    assert d["strategy"]["name"] == "zero3" and d["cluster"]["gpus"] == 8
    pg = d["per_gpu"]
    for k in ("weights_bytes", "master_weights_bytes", "grads_bytes", "optimizer_states_bytes",
              "activations_bytes", "buffers_bytes", "overhead_bytes", "peak_bytes"):
        assert isinstance(pg[k], int) and pg[k] >= 0
    assert pg["peak_bytes"] == sum(pg[k] for k in ("weights_bytes", "master_weights_bytes", "grads_bytes",
                                                   "optimizer_states_bytes", "activations_bytes", "buffers_bytes"))
    assert pg["master_weights_bytes"] == 4 * 6738415616 // 8
    assert pg["optimizer_states_bytes"] == 8 * 6738415616 // 8
    assert d["fits"] is None and d["headroom_bytes"] is None
    assert "activations" in d["assumptions"]


@pytest.mark.parametrize("argv", [["estimate", "llama-7b", "--gpus", "8", "--stage", "3", "--json"],
                                  ["plan", "llama-7b", "--gpu", "h100-80g", "--json"]])
def test_fast_path_does_not_import_torch(argv):
    code = ("import sys; from memplan.cli import main\n"
            f"try:\n    main({argv!r})\n"
            "except SystemExit: pass\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_fit_verdict_exit_codes():
    fits = run("estimate", "llama-7b", "--gpus", "8", "--stage", "3", "--gpu", "h100-80g", "--json")
    assert fits.returncode == 0 and json.loads(fits.stdout)["fits"] is True
    nofit = run("estimate", "llama-2-70b", "--gpus", "8", "--strategy", "ddp", "--gpu-memory", "80GB")
    assert nofit.returncode == 1
    assert "DOES NOT FIT" in nofit.stdout


def test_gb_vs_gib():
    a = json.loads(run("estimate", "gpt2", "--gpu-memory", "80GB", "--json").stdout)
    b = json.loads(run("estimate", "gpt2", "--gpu-memory", "80GiB", "--json").stdout)
    assert a["cluster"]["gpu_memory_bytes"] == 80 * 10**9
    assert b["cluster"]["gpu_memory_bytes"] == 80 * 2**30
    assert any("decimal" in n for n in a["notes"]) and any("binary" in n for n in b["notes"])


def test_a_shard_outside_the_model_directory_is_refused_unread(tmp_path):
    # an index whose weight_map climbs out of the directory (or is absolute) is refused before any file is opened
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, '
                                          '"num_attention_heads": 2, "vocab_size": 100, "intermediate_size": 128}')
    for bad in ("../../../../etc/passwd", "/etc/passwd"):
        (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "%s"}}' % bad)
        r = run("inspect", str(tmp_path))
        assert r.returncode == 2 and "is not a file inside" in r.stderr and "root:" not in r.stderr


def test_a_factory_that_exits_is_an_error_not_a_success(tmp_path):
    # sys.exit(0) in a factory (at import or when called) would end a CI gate with 0
    (tmp_path / "exits_mod.py").write_text("import sys\ndef build():\n    sys.exit(0)\n")
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    for spec, needle in (("exits_mod:build", "raised SystemExit"), ("exits_at_import:x", "cannot import")):
        r = subprocess.run([sys.executable, "-m", "memplan", "inspect", spec], capture_output=True, text=True,
                           cwd=ROOT, env={**os.environ, "PYTHONPATH": str(tmp_path)})
        assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_factory_that_never_returns_is_stopped(tmp_path):
    # a factory (or its module's import) that loops forever is stopped at MEMPLAN_FACTORY_TIMEOUT: one line, exit 2
    (tmp_path / "loops_mod.py").write_text("def build():\n    while True:\n        pass\n")
    (tmp_path / "loops_at_import.py").write_text("while True:\n    pass\n")
    for spec, doing in (("loops_mod:build", "building the model"), ("loops_at_import:x", "importing it")):
        r = subprocess.run([sys.executable, "-m", "memplan", "inspect", spec], capture_output=True, text=True,
                           cwd=ROOT, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(tmp_path), "MEMPLAN_FACTORY_TIMEOUT": "1"})
        assert r.returncode == 2 and f"did not finish {doing} within 1 s" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    bad = subprocess.run([sys.executable, "-m", "memplan", "inspect", "loops_mod:build"], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(tmp_path),
                                                   "MEMPLAN_FACTORY_TIMEOUT": "nan"})
    assert bad.returncode == 2 and bad.stderr.strip() == ("Error: MEMPLAN_FACTORY_TIMEOUT must be a positive number of "
                                                          "seconds, got 'nan'")


@pytest.mark.parametrize("args,needle", [
    (["estimate", "lama-7b"], "unknown preset 'lama-7b'"),
    (["estimate", "gpt2", "--stage", "5"], "--stage must be 0, 1, 2 or 3"),
    (["estimate", "gpt2", "--strategy", "zero9"], "unknown strategy 'zero9'; valid:"),
    (["estimate", "gpt2", "--precision", "fp4"], "unknown precision recipe"),
    (["estimate", "gpt2", "--precision", "fp8"], "finds no nn.Linear to swap"),
    (["estimate", "gpt2", "--optimizer", "sophia"], "unknown optimizer 'sophia'; valid:"),
    (["estimate", "gpt2", "--gpu", "tpu-v5"], "unknown GPU 'tpu-v5'; valid:"),
    (["estimate", "gpt2", "--gpus", "12", "--gpus-per-node", "8"], "gpus(12) is not a multiple of gpus_per_node(8)"),
    (["estimate", "gpt2", "--gpus", "-1"], "--gpus must be at least 1"),
    (["estimate", "gpt2", "--micro-batch", "0"], "micro-batch must be at least 1"),
    (["estimate", "gpt2", "--seq-len", "0"], "seq-len must be at least 1"),
    (["estimate", "gpt2", "--gpu-memory", "-80GB"], "memory size"),
    (["estimate", "gpt2", "--gpu-memory", "80XB"], "unknown unit"),
    (["estimate", "gpt2", "--gpu-memory", "80"], "has no unit: write 80GB (10^9), 80GiB (2^30) or 80B"),
    (["estimate", "gpt2", "--gpu-memory", "80G"], "is ambiguous: write 80GB (10^9) or 80GiB (2^30)"),
    (["estimate", "gpt2", "--strategy", "hsdp", "--gpus", "16", "--gpus-per-node", "8", "--hsdp-shard-size", "3"],
     "HSDP shard size(3)"),
    (["estimate", "gpt2", "--stage", "2", "--offload-param"], "needs ZeRO stage 3"),
    (["estimate", "gpt2", "--strategy", "fsdp-full", "--offload-optimizer"], "it needs ZeRO stage 1, 2 or 3"),
    (["estimate", "gpt2", "--stage", "0", "--offload-optimizer"], "it needs ZeRO stage 1, 2 or 3"),
    (["estimate", "gpt2", "--stage", "2", "--cpu-offload"], "--cpu-offload is FSDP's CPUOffloadPolicy"),
    (["estimate", "gpt2", "--cublas-workspace", "-1MiB"], "--cublas-workspace: memory size"),
    (["estimate", "gpt2", "--gpu-memory", "9" * 400 + "GB"], "more than 1 PiB"),
    (["validate", "gpt2", "--device", "cpu", "--strategy", "ddp", "--offload-optimizer"],
     "it needs ZeRO stage 1, 2 or 3"),
    (["inspect", "/nonexistent/config.json"], "no such file"),
    (["estimate", "gpt2", "--no-such-flag"], "No such option"),
    (["estimate", "gpt2", "--activations", "guess"], "--activations must be auto, traced or analytic"),
    (["validate", "gpt2", "--device", "cpu", "--layers", "0"], "--layers must be at least 1"),
    (["validate", "gpt2", "--device", "cpu", "--vocab", "1"], "--vocab must be at least 2"),
    (["validate", "gpt2", "--device", "cpu", "--tolerance", "0"], "--tolerance must be a positive number"),
    (["validate", "gpt2", "--device", "cpu", "--steps", "0"], "steps must be at least 1"),
    (["validate", "gpt2", "--device", "cpu", "--recompute", "selective"], "--recompute none, full, op-sac, every:N or layer-sac:N"),
    (["validate", "gpt2", "--device", "cpu", "--optimizer", "paged_adamw_8bit"], "paged optimizers need CUDA"),
    (["estimate", "gpt2", "--gpus", "2", "--strategy", "fsdp-full", "--optimizer", "adafactor"],
     "cannot step (they mix plain tensors with DTensors"),
    (["estimate", "gpt2", "--precision", "fp32", "--attention", "flash"], "flash attention needs fp16/bf16"),
    (["estimate", "gpt2", "--attention", "flash", "--gpu", "v100-32g"], "needs an sm80 or newer GPU, not sm70"),
    (["estimate", "deepseek-v3", "--attention", "flash"], "one head dim up to 256 for q, k and v, not 192/128"),
    (["estimate", "gpt2", "--device", "cpu", "--cpu-isa", "sse"], "--cpu-isa must be one of avx2, avx512"),
    (["estimate", "gpt2", "--cpu-isa", "amx"], "--cpu-isa applies to --device cpu"),
    (["plan", "gpt2", "--gpu", "h100-80g", "--max-gpus", "1000000000"], "more than the 1,048,576 GPUs"),
    (["plan", "gpt2", "--gpu", "h100-80g", "--max-micro-batch", "1000000"], "more than the 4,096"),
    (["estimate", "gpt2", "--deepspeed", "/dev/zero"], "is not a regular file"),
    (["estimate", "gpt2", "--deepspeed", "/"], "is not a regular file"),
    (["estimate", "mixtral-8x7b", "--gpus", "6", "--ep", "3", "--strategy", "fsdp-full"],
     "--ep 3 does not divide the 8 routed experts"),
    (["estimate", "llama-7b", "--gpus", "2", "--ep", "2", "--strategy", "fsdp-full"], "has no routed experts"),
    (["estimate", "mixtral-8x7b", "--gpus", "8", "--ep", "2", "--stage", "3"], "--ep with --strategy zero3"),
    (["estimate", "llama-7b", "--gpus", "4", "--cp", "4", "--seq-len", "1004", "--strategy", "fsdp-full"],
     "--cp 4 does not divide the sequence"),
    (["estimate", "llama-7b", "--gpus", "6", "--cp", "4", "--strategy", "fsdp-full"], "x cp(4) = 4"),
])
def test_bad_input_one_line_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


def test_deepspeed_file(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": True,
                                 "offload_optimizer": {"device": "cpu"}, "mystery_knob": 1},
           "optimizer": {"type": "AdamW"}}
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(cfg))
    r = run("estimate", "llama-7b", "--gpus", "8", "--deepspeed", str(p), "--micro-batch", "2", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["strategy"]["name"] == "zero2" and d["strategy"]["grad_accum"] == 4
    assert d["strategy"]["deepspeed"]["reduce_bucket_size"] == 4096 * 4096  # "auto" = hidden_size^2 (HF Trainer)
    assert d["strategy"]["deepspeed"]["offload_optimizer"] is True and d["per_gpu"]["optimizer_states_bytes"] == 0
    assert d["assumptions"]["setting_sources"]["strategy"] == str(p)
    assert any("mystery_knob" in n for n in d["notes"])
    over = run("estimate", "llama-7b", "--gpus", "8", "--deepspeed", str(p), "--stage", "3", "--json")
    assert json.loads(over.stdout)["strategy"]["name"] == "zero3"
    assert any("overrides" in n for n in json.loads(over.stdout)["notes"])
    p.write_text(json.dumps({"zero_optimization": {"stage": 3, "memory_efficient_linear": False}}))
    d = json.loads(run("estimate", "llama-7b", "--deepspeed", str(p), "--json").stdout)
    assert d["strategy"]["deepspeed"]["memory_efficient_linear"] is False
    assert not any("memory_efficient_linear" in n for n in d["notes"])  # modelled, not ignored
    p.write_text(json.dumps({"zero_optimization": {"stage": 3, "memory_efficient_linear": "maybe"}}))
    bad = run("estimate", "llama-7b", "--deepspeed", str(p))
    assert bad.returncode == 2 and "memory_efficient_linear must be true or false" in bad.stderr
    p.write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    bad = run("estimate", "llama-7b", "--deepspeed", str(p))
    assert bad.returncode == 2 and "stage must be 0, 1, 2 or 3" in bad.stderr


def test_inspect_and_presets_json():
    d = json.loads(run("inspect", "llama-7b", "--json").stdout)
    assert d["model"]["num_params"] == 6738415616 and d["num_blocks"] == 32
    assert d["largest_block"]["num_params"] == 202383360
    p = json.loads(run("presets", "--json").stdout)
    names = {m["name"] for m in p["models"]}
    assert {"gpt2", "gpt2-xl", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b",
            "llama-3.1-405b", "mistral-7b", "mixtral-8x7b", "qwen2.5-7b", "qwen2.5-72b", "deepseek-v3"} <= names
    gpus = {g["id"] for g in p["gpus"]}
    assert {"a100-40g", "a100-80g", "h100-80g", "h200-141g", "b200-180g", "l40s-48g", "rtx4090-24g", "v100-32g",
            "mi300x-192g"} <= gpus
    assert all(g["source"] and g["usable_bytes"] > 0 for g in p["gpus"])


@pytest.mark.parametrize("command", ["estimate", "inspect", "presets"])
def test_every_command_has_help_and_is_in_readme(command):
    r = run(command, "--help")
    assert r.returncode == 0 and "Usage" in r.stdout
    assert f"memplan {command}" in (ROOT / "README.md").read_text()


def test_cublas_workspace_zero_is_accepted():
    # CUBLAS_WORKSPACE_CONFIG=:0:0 is a setting jobs use: no workspace
    d = json.loads(run("estimate", "gpt2", "--cublas-workspace", "0", "--json").stdout)
    assert d["assumptions"]["blas_workspace"].startswith("2 x 0 B")


def test_an_internal_error_is_one_line(monkeypatch, capsys):
    # a bug below the CLI gives one line and exit 1, not a traceback (MEMPLAN_DEBUG=1 re-raises)
    from memplan import cli

    def boom(*a, **k):
        raise ValueError("a bug\nsecond line")

    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    monkeypatch.setattr("memplan.model.sources.resolve", boom)
    with pytest.raises(SystemExit) as ex:
        cli.main(["estimate", "gpt2"])
    err = capsys.readouterr().err
    assert ex.value.code == 1 and err == "Error: internal error (ValueError: a bug); MEMPLAN_DEBUG=1 shows where\n"


def test_one_gpu_defaults_to_plain_pytorch_without_ddp_buckets():
    # a one-GPU fine-tuning script runs no DDP: no reducer buckets (the default at --gpus 1, said in a note);
    # --strategy ddp still models them, exactly the gradients' size more in every phase but the step
    single = json.loads(run("estimate", "llama-3-8b", "--json").stdout)
    ddp = json.loads(run("estimate", "llama-3-8b", "--strategy", "ddp", "--json").stdout)
    assert single["strategy"]["name"] == "single" and single["assumptions"]["setting_sources"]["strategy"] == "default"
    assert any("no reducer buckets" in n for n in single["notes"])
    grads = ddp["phases"][3]["grads_bytes"]  # fp32 gradients at backward's end (torch-amp)
    assert ddp["phases"][0]["buffers_bytes"] - single["phases"][0]["buffers_bytes"] == grads == 4 * 8_030_261_248
    assert single["reserved"]["framework_sequence"] == "PyTorch"
    bad = run("estimate", "llama-3-8b", "--strategy", "single", "--gpus", "2")
    assert bad.returncode == 2 and "runs on one GPU, not 2" in bad.stderr


def test_deepspeed_legacy_and_unmodelled_keys(tmp_path):
    # DeepSpeed 0.19.8 still reads the deprecated cpu_offload as offload_optimizer {"device": "cpu"} and
    # cpu_offload_param as offload_param (zero/config.py); false leaves no offload
    from memplan import dsconfig

    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": "true",
                                                   "zero_quantized_gradients": True, "reduce_scatter": True,
                                                   "use_multi_rank_bucket_allreduce": False}}))
    d = dsconfig.load(str(p))
    assert d.knobs["offload_optimizer"] is True and d.knobs["offload_param"] is True
    assert d.knobs["quantized_gradients"] is True  # ZeRO++ qgZ is read (frameworks/zero3.py qgz_transient)
    assert not d.unknown_keys
    # the reduce path's keys are read (their notes come with the settings: options._reduce_path_notes)
    assert d.knobs["reduce_scatter"] is True and d.knobs["multi_rank_bucket_allreduce"] is False
    assert d.notes == ()
    p.write_text(json.dumps({"zero_optimization": {"stage": 2, "cpu_offload": False}}))
    assert "offload_optimizer" not in dsconfig.load(str(p)).knobs


def test_every_option_is_in_the_readme_and_every_command_has_an_example():
    import typer

    from memplan.cli import app

    readme = (ROOT / "README.md").read_text()
    cmd = typer.main.get_command(app)
    missing = [f"{name} {opt}" for name, sub in cmd.commands.items() for p in sub.params
               for opt in (*p.opts, *p.secondary_opts) if opt.startswith("--") and opt not in readme]
    assert not missing, missing
    for name, sub in cmd.commands.items():
        assert "Example: memplan " + name in " ".join((sub.help or "").split()), name
    assert "--install-completion" in [o for p in cmd.params for o in p.opts]


def test_ddp_reserved_line_names_both_release_orders():
    # DDP's first buckets come back at the rebuild or, held by NCCL's watchdog, in step 2's backward (a race):
    # the verdict takes the larger figure and the line under the table shows the other
    r = run("estimate", "gpt2", "--gpus", "2", "--strategy", "ddp", "--gpu", "h100-80g", "--json")
    d = json.loads(r.stdout)
    v = d["reserved"]["variants"]
    assert set(v) == {"buckets released at the rebuild", "buckets held into step 2's backward"}
    held, rebuilt = v["buckets held into step 2's backward"], v["buckets released at the rebuild"]
    assert held > rebuilt and d["per_gpu"]["reserved_peak_bytes"] == held
    text = run("estimate", "gpt2", "--gpus", "2", "--strategy", "ddp", "--gpu", "h100-80g").stdout
    line = next(x for x in text.splitlines() if x.startswith("peak reserved:"))
    assert "the larger of 2 release orders (buckets held into step 2's backward)" in line
    assert line.endswith(f"{fmt_bytes(rebuilt)} with buckets released at the rebuild")


def test_notes_are_printed_as_written(tmp_path):
    # a note quoting the job's own text keeps its brackets (rich markup is off for notes): the Trainer's
    # optim_target_modules list as memplan reads it
    from test_bad_inputs import run_cli

    args = tmp_path / "train_args.json"
    args.write_text('{"optim": "galore_adamw", "optim_target_modules": [".*.attn.*", ".*.mlp.*"]}')
    code, out, err = run_cli(["estimate", "llama-7b", "--training-args", str(args), "--no-suggestions"])
    assert code == 0, err
    assert 'optim_target_modules [r".*.attn.*", r".*.mlp.*"]' in out
