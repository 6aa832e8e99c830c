"""--recompute every:N on the command line and from the Trainer's activation_checkpointing_kwargs
(memplan/jobfiles.py)."""

from __future__ import annotations

import json

from test_bad_inputs import run_cli


def test_training_arguments_every_n_layers_and_offload(tmp_path):
    ta = tmp_path / "ta.json"
    ta.write_text(json.dumps({"per_device_train_batch_size": 1, "bf16": True, "activation_checkpointing": True,
                              "activation_checkpointing_kwargs": {"every_n_layers": 4, "offload": True}}))
    code, out, err = run_cli(["estimate", "llama-7b", "--gpus", "8", "--strategy", "fsdp-full", "--training-args",
                              str(ta), "--activations", "analytic", "--json"])
    assert code in (0, 1), err
    rep = json.loads(out)
    assert rep["strategy"]["recompute"] == "every:4"
    assert any("offload" in n and "upper bound" in n for n in rep["notes"])
    ta.write_text(json.dumps({"gradient_checkpointing": True,
                              "gradient_checkpointing_kwargs": '{"every_n_layers": 1}'}))
    code, out, err = run_cli(["estimate", "llama-7b", "--gpus", "8", "--training-args", str(ta),
                              "--activations", "analytic", "--json"])
    assert json.loads(out)["strategy"]["recompute"] == "full"
    ta.write_text(json.dumps({"activation_checkpointing": True,
                              "activation_checkpointing_kwargs": {"every_n_layers": 0}}))
    code, out, err = run_cli(["estimate", "llama-7b", "--training-args", str(ta)])
    assert code == 2 and "every_n_layers" in err and err.count("\n") == 1


def test_bad_every_is_one_line_exit_2():
    code, out, err = run_cli(["estimate", "llama-7b", "--recompute", "every:0"])
    assert code == 2 and "every:N" in err and err.count("\n") == 1 and not out
