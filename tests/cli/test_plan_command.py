"""The command `memplan plan` prints carries every option of the job it was given (the request's flags), so that
running it gives the recommendation's bytes: a LoRA job's plan names its adapter."""

from __future__ import annotations

import json
import shlex

import pytest
from test_bad_inputs import run_cli


def test_a_lora_plan_s_command_reproduces_its_bytes() -> None:
    code, out, err = run_cli("plan llama-3-8b --gpu a100-40g --lora-rank 16 --max-gpus 8 --activations analytic "
                             "--json".split())
    assert code == 0, err
    rep = json.loads(out)
    command = rep["recommendation"]["command"]
    assert "--lora-rank 16" in command and "--activations analytic" in command
    code, out, err = run_cli(shlex.split(command)[1:] + ["--json"])
    assert code == 0, err
    again = json.loads(out)["per_gpu"]
    assert (again["peak_bytes"], again["required_bytes"]) == \
        (rep["estimate"]["per_gpu"]["peak_bytes"], rep["estimate"]["per_gpu"]["required_bytes"])


def test_check_takes_every_option_estimate_takes() -> None:
    # one request, one set of options: the CI gate describes the job as estimate does (before, check took a subset)
    args = "llama-3-8b --gpus 8 --stage 3 --offload-optimizer --tp 2 --activations analytic --gpu h100-80g".split()
    code, out, err = run_cli(["estimate"] + args + ["--json"])
    assert code == 0, err
    required = json.loads(out)["per_gpu"]["required_bytes"]
    code, out, err = run_cli(["check"] + args + ["--json"])
    assert code in (0, 1), err
    assert json.loads(out)["estimate"]["per_gpu"]["required_bytes"] == required


@pytest.mark.parametrize("model,gpu", [("llama-3-8b", "a100-40g"), ("llama-3-8b", "h100-80g"), ("mistral-7b", "h100-80g"),
                                       ("gpt2", "a100-40g")])
def test_every_exact_row_s_command_reproduces_it(model: str, gpu: str) -> None:
    # issue 45: every row of the plan is an estimate its printed command gives byte for byte; a bound has none.
    # Analytic activations (fast) have no traced step to replay the allocator over: the user's flat allocator
    # percentage makes the rows exact (without it every row is a bound from below, issue 42)
    code, out, err = run_cli(f"plan {model} --gpu {gpu} --max-gpus 64 --activations analytic "
                             "--fragmentation-percent 10 --json".split())
    assert code == 0, err
    rows = [c for c in json.loads(out)["candidates"] if c["at_recommended_gpus"]]
    assert any(r["at_recommended_gpus"]["command"] for r in rows)
    for row in rows:
        at = row["at_recommended_gpus"]
        if not row["exact"]:
            assert at["command"] is None  # a bound is labelled, and has no command to run
            continue
        code, out, err = run_cli(shlex.split(at["command"])[1:] + ["--json"])
        assert code in (0, 1), err
        got = json.loads(out)["per_gpu"]
        assert (got["peak_bytes"], got["required_bytes"]) == (at["peak_bytes"], at["required_bytes"]), at["command"]
