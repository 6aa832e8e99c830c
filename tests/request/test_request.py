"""The job request (memplan/request.py): one field per option with its flag and file keys, the command line built
from it, the printed flags that give it back, and the one merge of the job's files (jobfiles.merged)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from typer.main import get_command

from memplan import jobfiles, options
from memplan.cli import app
from memplan.errors import MemplanError
from memplan.model.sources import build_inventory, resolve
from memplan.request import PARTS, JobRequest, from_command, keys

ROOT = Path(__file__).resolve().parents[2]
FLAT = [(part, name, key) for part, cls in PARTS.items() for name, _, key in keys(cls)]


def _help(command: str) -> str:
    return CliRunner().invoke(get_command(app), [command, "--help"], terminal_width=400).output


def test_every_field_has_one_name_and_its_flag_is_an_estimate_option() -> None:
    names = [name for _, name, _ in FLAT]
    assert len(names) == len(set(names))
    flags = [key.flag for _, _, key in FLAT if key.flag]
    assert len(flags) == len(set(flags))
    shown = _help("estimate")
    for flag in flags:
        assert flag.split("/")[0] in shown, flag


@pytest.mark.parametrize("command", ["check", "plan", "validate"])
def test_the_other_commands_take_their_options_from_the_same_fields(command: str) -> None:
    shown = _help(command)
    for flag in ("--gpu-memory" if command != "validate" else "--optimizer-impl", "--lora-rank", "--cpu-isa"):
        assert flag in shown, (command, flag)


def test_a_command_line_value_is_parsed_as_its_field_says() -> None:
    r = from_command({"model": "gpt2", "cuda_context_bytes": "1GiB", "leaf_classes": "none",
                      "reshard_after_forward": "4", "horovod_fusion_threshold": "0"}, ["cuda_context_bytes"])
    assert (r.memory.cuda_context_bytes, r.deepspeed.leaf_classes, r.torch.reshard_after_forward,
            r.horovod.horovod_fusion_threshold) == (1 << 30, (), 4, 0)
    assert r.source("cuda_context_bytes") == "command line" and r.source("leaf_classes") is None
    with pytest.raises(MemplanError, match="--cuda-context"):
        from_command({"cuda_context_bytes": "lots"})


def test_the_flags_give_back_the_request() -> None:
    r = JobRequest.of(micro_batch=4, overlap_comm=False, leaf_classes=(), reshard_after_forward=False,
                      double_quant=True, sp=True, tp=2, cuda_context_bytes=1 << 29, allocator_conf="a b")
    assert r.flags() == ["--micro-batch 4", "--tp 2", "--sp", "--double-quant", "--no-overlap-comm",
                         "--z3-leaf-modules none", "--reshard-after-forward false", "--cuda-context 536870912",
                         "--allocator-conf 'a b'"]
    assert r.flags({"micro_batch"}) == ["--micro-batch 4"]
    assert JobRequest().flags() == []


def test_changed_counts_its_values_as_given() -> None:
    r = JobRequest.of(gpus=8).changed(stage=3)
    assert (r.cluster.gpus, r.training.stage, r.source("stage"), r.source("micro_batch")) == \
        (8, 3, "command line", None)
    with pytest.raises(TypeError):
        r.changed(no_such_option=1)


def test_the_files_merge_in_one_place_with_their_sources(tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": True},
                              "train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": True}}))
    ta = tmp_path / "args.json"
    ta.write_text(json.dumps({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "bf16": True,
                              "deepspeed": "ds.json"}))
    asked = JobRequest.of(gpus=8, training_args=str(ta), overlap_comm=False)
    merged, notes, files = jobfiles.merged(asked, 4096)
    assert (merged.batch.micro_batch, merged.training.stage, merged.deepspeed.reduce_bucket_size,
            merged.deepspeed.overlap_comm) == (4, 2, 4096 * 4096, False)
    assert (merged.source("micro_batch"), merged.source("stage"), merged.source("reduce_bucket_size"),
            merged.source("overlap_comm")) == (str(ta), str(ds), str(ds), "command line")
    assert f"overlap_comm: command line False overrides {ds} True" in notes
    assert files == [str(ta)]
    inv = build_inventory(resolve("llama-3-8b"))
    got = options.resolve(inv, asked.changed(activations="analytic"))
    assert got.settings.strategy.name == "zero2" and got.sources["strategy"] == str(ds)
    assert got.sources["micro_batch"] == str(ta) and got.sources["grad_accum"] == str(ta)


OPTIONS_PATH = ("request.py", "options.py", "jobfiles.py", "dsconfig.py", "cli_options.py", "cli_estimate.py",
                "planner.py", "validation.py", "cli.py")


@pytest.mark.parametrize("module", OPTIONS_PATH)
def test_no_function_on_the_options_path_takes_more_than_eight_parameters(module: str) -> None:
    import ast

    tree = ast.parse((ROOT / "memplan" / module).read_text())
    wide = [f"{n.name}: {len(n.args.posonlyargs) + len(n.args.args) + len(n.args.kwonlyargs)}"
            for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
            and len(n.args.posonlyargs) + len(n.args.args) + len(n.args.kwonlyargs) > 8]
    assert wide == []


def test_a_field_s_ds_config_key_is_the_one_the_reader_reads(tmp_path: Path) -> None:
    # each DeepSpeed field whose Key names a zero_optimization key: a config setting only that key gives the field
    # that value, sourced from the file (jobfiles.merged over dsconfig.load)
    from memplan.dsconfig import ZERO_KEYS

    checked = 0
    for part, name, key in FLAT:
        if not (key.ds_config or "").startswith("zero_optimization.") or "." in key.ds_config[18:]:
            continue
        zkey = key.ds_config[len("zero_optimization."):]
        if zkey == "stage":
            continue
        assert ZERO_KEYS[zkey] == name, (name, zkey)
        import typing

        value = True if bool in typing.get_args(typing.get_type_hints(PARTS[part])[name]) else 12345
        cfg = tmp_path / f"{name}.json"
        cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, zkey: value}}))
        merged, _, _ = jobfiles.merged(JobRequest.of(deepspeed=str(cfg)), 4096)
        assert (merged[name], merged.source(name)) == (value, str(cfg)), name
        checked += 1
    assert checked >= 15


def test_docs_options_table_is_current() -> None:
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from options_table import table

    assert (ROOT / "docs" / "options.md").read_text() == table()


def test_training_arguments_ddp_bucket_cap_reaches_ddp(tmp_path: Path) -> None:
    ta = tmp_path / "args.json"
    ta.write_text(json.dumps({"per_device_train_batch_size": 1, "ddp_bucket_cap_mb": 50}))
    inv = build_inventory(resolve("llama-3-8b"))
    got = options.resolve(inv, JobRequest.of(gpus=8, training_args=str(ta), activations="analytic"))
    assert (got.settings.torch.bucket_cap_mb, got.settings.torch.bucket_cap_default) == (50, False)
    assert got.sources["bucket_cap_mb"] == str(ta)


@pytest.mark.parametrize("given,job,said", [
    (dict(reduce_bucket_size=1000), dict(strategy="fsdp-full"), "--reduce-bucket-size changes nothing for this job "
     "(fsdp-full): only DeepSpeed reads it"),
    (dict(overlap_comm=False), dict(strategy="ddp"), "--no-overlap-comm changes nothing"),
    (dict(max_live_parameters=10), dict(stage=1), "only DeepSpeed ZeRO-3 reads it"),
    (dict(bucket_cap_mb=50), dict(stage=2), "only DistributedDataParallel"),
    (dict(hsdp_shard_size=4), dict(strategy="fsdp-full"), "only HSDP"),
    (dict(schedule="gpipe"), dict(stage=3), "only pipeline parallelism"),
    (dict(pin_memory=True), dict(stage=3), "only offload"),
])
def test_an_option_this_job_does_not_read_is_said(given: dict, job: dict, said: str) -> None:
    inv = build_inventory(resolve("llama-3-8b"))
    notes = options.resolve(inv, JobRequest.of(gpus=8, activations="analytic", **job, **given)).notes
    assert any(said in n for n in notes), notes


@pytest.mark.parametrize("given,job", [
    (dict(reduce_bucket_size=1000), dict(stage=2)), (dict(bucket_cap_mb=50), dict(strategy="ddp")),
    (dict(pin_memory=True, offload_optimizer=True), dict(stage=3)), (dict(fsdp_version=2), dict(strategy="ddp")),
    (dict(max_live_parameters=10), dict(stage=3)), (dict(reshard_after_forward=False), dict(strategy="fsdp-full")),
])
def test_an_option_this_job_reads_is_not(given: dict, job: dict) -> None:
    inv = build_inventory(resolve("llama-3-8b"))
    notes = options.resolve(inv, JobRequest.of(gpus=8, activations="analytic", **job, **given)).notes
    assert not any("changes nothing" in n for n in notes), notes


def test_the_readme_library_example_runs_and_matches_the_command_line(capsys: pytest.CaptureFixture) -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("### As a library", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "README.md", "exec"), {})
    first = capsys.readouterr().out.splitlines()[0].split()
    code, out, err = _cli("estimate llama-3-8b --gpus 8 --stage 3 --micro-batch 2 --gpu h100-80g --json")
    got = json.loads(out)["per_gpu"]
    assert first == [str(got["peak_bytes"]), str(got["required_bytes"]), "True"]
    assert f"{got['peak_bytes']} {got['required_bytes']} True" in block  # the figures the comment shows


def _cli(args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(get_command(app), args.split())
    return result.exit_code, result.stdout, ""


def test_a_printed_image_size_is_the_option_s_own_text() -> None:
    """--image-size 448 is (448, 448); a printed command (a plan's details) gives it back as 448x448."""
    req = JobRequest.of(image_size=(448, 644))
    assert req.flags(["image_size"]) == ["--image-size 448x644"]
