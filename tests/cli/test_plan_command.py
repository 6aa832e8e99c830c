"""The command `memplan plan` prints carries every option of the job it was given (the request's flags), so that
running it gives the recommendation's bytes: a LoRA job's plan names its adapter."""

from __future__ import annotations

import json
import shlex

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
