"""`memplan estimate --json` against its published schema (memplan/schema/estimate-v1.schema.json), over
strategies, devices, offload, a verdict and none; and the bytes are the same on every run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")

from test_bad_inputs import run_cli  # noqa: E402

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "memplan" / "schema" / "estimate-v1.schema.json")
                    .read_text())

CASES = [
    "estimate gpt2 --json",
    "estimate llama-7b --gpus 8 --stage 3 --gpu h100-80g --json",
    "estimate llama-7b --gpus 8 --stage 2 --offload-optimizer --host-memory 1TiB --json",
    "estimate mixtral-8x7b --gpus 16 --strategy hsdp --gpu-memory 80GB --json",
    "estimate llama-7b --gpus 4 --strategy fsdp-full --fsdp-version 1 --recompute full --json",
    "estimate gpt2 --gpus 2 --strategy zero-optimizer --device cpu --json",
    "estimate llama-7b --gpus 64 --gpu a100-40g --json",
    "estimate llama-7b --gpus 8 --strategy horovod --horovod-compression fp16 --gpu h100-80g --explain --json",
    "estimate llama-3-8b --gpus 8 --strategy ddp --gpu h100-80g --json",
    "estimate llama-3-8b --gpus 16 --tp 4 --pp 2 --sp --strategy fsdp-full --grad-accum 4 --activations analytic "
    "--gpu h100-80g --json",
    "estimate llama-3-8b --gpus 8 --pp 4 --stage 1 --grad-accum 8 --activations analytic --json",
    "estimate llama-3-8b --gpus 8 --pp 2 --strategy fsdp-full --grad-accum 8 --schedule dualpipev --gpu h100-80g "
    "--json",
    "estimate mixtral-8x7b --gpus 16 --ep 8 --strategy fsdp-full --activations analytic --gpu h100-80g --json",
    "estimate llama-3-8b --gpus 16 --cp 4 --seq-len 32768 --strategy fsdp-full --activations analytic --json",
    "estimate gpt2 --gpus 2 --strategy ddp --compile blocks --seq-len 256 --gpu h100-80g --json",
    "estimate llama-3-8b --gpus 8 --strategy fsdp-full --precision fp8-rowwise --seq-len 1024 --gpu h100-80g --json",
    # a vision-language model (its task, images and image size in the JSON; with -m slow: the quick suite's budget)
    pytest.param("estimate qwen2.5-vl-7b --image-size 448x644 --images 2 --seq-len 4096 --gpus 8 --stage 3 --json",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("args", CASES)
def test_estimate_json_follows_the_schema(args):
    code, out, err = run_cli(args.split())
    assert code in (0, 1), err
    jsonschema.validate(json.loads(out), SCHEMA)


@pytest.mark.parametrize("args", ["plan gpt2 --gpu h100-80g --json", "plan llama-7b --gpu a100-40g --max-gpus 2 --json",
                                  "plan llama-3-8b --gpu a100-40g --max-gpus 16 --layouts --strategies fsdp-full "
                                  "--recompute full --activations analytic --json"])
def test_plan_json_follows_the_schema(args):
    # plan-v1 refers to estimate-v1 for the recommended configuration's estimate
    from referencing import Registry, Resource

    base = Path(__file__).resolve().parents[2] / "memplan" / "schema"
    plan_schema = json.loads((base / "plan-v1.schema.json").read_text())
    registry = Registry().with_resource("https://memplan.dev/schema/estimate-v1.schema.json",
                                        Resource.from_contents(SCHEMA))
    code, out, err = run_cli(args.split())
    assert code in (0, 1), err
    d = json.loads(out)
    jsonschema.Draft202012Validator(plan_schema, registry=registry).validate(d)
    assert (d["recommendation"] is None) == (code == 1)


def test_estimate_json_is_the_same_bytes_every_run():
    # separate processes with different string hashing: nothing may follow a set's or a hash's order
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", "memplan", "estimate", "llama-7b", "--gpus", "8", "--deepspeed", str(Path(__file__)
            .resolve().parents[2] / "tests" / "cli" / "ds_stage3.json"), "--gpu", "h100-80g", "--json"]
    outs = {subprocess.run(args, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2", "3")}
    assert len(outs) == 1 and json.loads(outs.pop())["strategy"]["name"] == "zero3"


@pytest.mark.parametrize("args", ["check llama-3-8b --gpus 8 --stage 2 --gpu h100-80g --json",
                                  "check llama-3-8b --gpus 8 --strategy ddp --gpu h100-80g --max-fraction 0.9 --json"])
def test_check_json_follows_the_schema(args):
    from referencing import Registry, Resource

    base = Path(__file__).resolve().parents[2] / "memplan" / "schema"
    check_schema = json.loads((base / "check-v1.schema.json").read_text())
    registry = Registry().with_resource("https://memplan.dev/schema/estimate-v1.schema.json",
                                        Resource.from_contents(SCHEMA))
    code, out, err = run_cli(args.split())
    assert code in (0, 1), err
    d = json.loads(out)
    jsonschema.Draft202012Validator(check_schema, registry=registry).validate(d)
    assert d["check"]["pass"] == (code == 0)
