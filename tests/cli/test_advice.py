"""'To fit' suggestions (memplan/advice.py): made only when a GPU is given and the job does not fit or fits with
under 10% free; every suggested change, given to `memplan estimate` on its own, really fits with the bytes shown."""

from __future__ import annotations

import json

import pytest
from test_bad_inputs import run_cli

TIGHT = [
    # DDP replicates everything: only sharding fits
    "estimate llama-3-8b --gpus 8 --strategy ddp --gpu h100-80g",
    # activations: a smaller micro-batch, or recomputation
    "estimate llama-3-8b --gpus 8 --stage 1 --micro-batch 8 --gpu h100-80g",
    # 4 GiB short under ZeRO-3: micro-batch, recompute, more GPUs
    "estimate llama-3-8b --gpus 8 --stage 3 --micro-batch 4 --gpu h100-80g",
    # one GPU: only DeepSpeed's ZeRO-Offload
    "estimate llama-3-8b --gpus 1 --gpu h100-80g",
    # FSDP on a 40 GB card
    "estimate llama-7b --gpus 4 --strategy fsdp-full --micro-batch 2 --gpu a100-40g",
    # fp32 on one GPU: pure bf16 (the weights, gradients and states halved), or ZeRO-3 offload
    "estimate llama-3-8b --gpus 1 --precision fp32 --gpu h100-80g",
    # LoRA on a 24 GB card: QLoRA (the job's inventory quantized: memplan.model.lora.apply)
    "estimate llama-3-8b --gpus 1 --lora-rank 16 --precision pure-bf16 --gpu rtx4090-24g",
]


def _estimate(args: str) -> tuple[int, dict]:
    code, out, err = run_cli(args.split() + ["--json"])
    assert code in (0, 1), err
    return code, json.loads(out)


@pytest.mark.parametrize("args", TIGHT)
def test_every_suggestion_fits_when_estimated_on_its_own(args):
    code, rep = _estimate(args)
    sug = rep["suggestions"]
    assert code == 1 and rep["fits"] is False and sug["reason"] == "does not fit"
    assert sug["changes"], sug
    ranks = [c["rank"] for c in sug["changes"]]
    assert ranks == sorted(ranks)  # cheapest first
    for ch in sug["changes"]:
        # the flags as given override the same options earlier on the line (typer keeps the last)
        code2, new = _estimate(args + " " + " ".join(ch["flags"]) + " --no-suggestions")
        assert code2 == 0 and new["fits"] is True, ch
        assert new["per_gpu"]["required_bytes"] == ch["required_bytes"]
        assert new["headroom_bytes"] == ch["headroom_bytes"] > 0
        assert ch["saves_bytes"] == rep["per_gpu"]["required_bytes"] - ch["required_bytes"] > 0


def test_suggestions_only_when_wanted():
    # no GPU: no verdict, no suggestions; plenty of room: none either
    assert "suggestions" not in _estimate("estimate llama-3-8b --gpus 8 --stage 3")[1]
    assert "suggestions" not in _estimate("estimate gpt2 --gpus 2 --gpu h100-80g")[1]
    assert "suggestions" not in _estimate("estimate llama-3-8b --gpus 8 --strategy ddp --gpu h100-80g "
                                          "--no-suggestions")[1]


def test_a_tight_fit_gets_changes_that_leave_ten_percent():
    # fits, with under 10% of the card free: each change listed leaves at least 10% free
    code, rep = _estimate("estimate llama-3-8b --gpus 8 --stage 1 --micro-batch 2 --grad-accum 4 --gpu h100-80g")
    cap = rep["cluster"]["gpu_memory_bytes"]
    assert code == 0 and rep["fits"] and rep["headroom_bytes"] < 0.1 * cap
    sug = rep["suggestions"]
    assert sug["reason"].startswith("headroom under") and sug["changes"]
    assert all(c["headroom_bytes"] >= 0.1 * cap for c in sug["changes"])


def test_the_table_lists_the_changes():
    code, out, _ = run_cli("estimate llama-3-8b --gpus 1 --gpu h100-80g".split())
    assert code == 1
    assert "To fit (does not fit)" in out and "--strategy zero2" in out and "--offload-optimizer" in out


def test_bf16_and_qlora_are_offered_where_they_apply():
    # an fp32 job: pure bf16 (--precision); a LoRA job: QLoRA, with the storage FSDP2 shards; DeepSpeed never gets
    # pure bf16 (its bf16 keeps an fp32 master: options refuse the recipe, so the change is dropped)
    _, rep = _estimate("estimate llama-3-8b --gpus 1 --precision fp32 --gpu h100-80g")
    assert ["--precision", "pure-bf16"] in [c["flags"] for c in rep["suggestions"]["changes"]]
    _, rep = _estimate("estimate llama-3-8b --gpus 1 --lora-rank 16 --precision pure-bf16 --gpu rtx4090-24g")
    assert [c["flags"] for c in rep["suggestions"]["changes"]] == [["--quantize-base", "nf4"]]
    _, rep = _estimate("estimate llama-3-8b --gpus 2 --strategy fsdp-full --lora-rank 16 --precision pure-bf16 "
                       "--micro-batch 4 --gpu rtx4090-24g")
    assert rep["suggestions"]["combination"]["flags"][-4:] == ["--quantize-base", "nf4", "--quant-storage",
                                                               "bfloat16"]
    # DeepSpeed in fp32: its own bf16 (an fp32 master kept), with ZeRO-3
    _, rep = _estimate("estimate llama-3-8b --gpus 8 --stage 2 --precision fp32 --gpu a100-40g")
    assert rep["suggestions"]["combination"]["flags"] == ["--stage", "3", "--precision", "deepspeed-bf16"]


def test_a_suggestion_on_top_of_job_files_is_priced_as_its_command_runs(tmp_path):
    # TrainingArguments with bf16 under DDP (torch-amp); a suggested strategy of another framework takes the same
    # mixed precision in its own recipe (fsdp-bf16, deepspeed-bf16), as the printed command does when it runs
    args = tmp_path / "train_args.json"
    args.write_text('{"per_device_train_batch_size": 2, "bf16": true}')
    base = f"estimate llama-3-8b --training-args {args} --gpus 8 --gpu a100-80g"
    code, rep = _estimate(base)
    assert code == 1 and rep["suggestions"]["changes"]
    for ch in rep["suggestions"]["changes"]:
        _, again = _estimate(base + " " + " ".join(ch["flags"]))
        assert again["per_gpu"]["required_bytes"] == ch["required_bytes"], ch["flags"]


@pytest.mark.parametrize("args", ["estimate llama-3-8b --gpus 2 --stage 2 --seq-len 8192 --micro-batch 2 --gpu a100-40g",
                                  "estimate llama-3-70b --gpus 8 --stage 2 --gpu h100-80g",
                                  # FSDP2 LoRA: QLoRA with the codes packed into bf16 parameters FSDP2 shards
                                  "estimate llama-3-8b --gpus 2 --strategy fsdp-full --lora-rank 16 --precision "
                                  "pure-bf16 --micro-batch 4 --gpu rtx4090-24g"])
def test_where_no_single_change_fits_the_cheapest_combination_is_given_and_reproduces(args):
    code, rep = _estimate(args)
    sug = rep["suggestions"]
    assert code == 1 and not sug["changes"] and sug["combination"] is not None
    combo = sug["combination"]
    assert len(combo["flags"]) >= 4  # at least two changes
    code, again = _estimate(args + " " + " ".join(combo["flags"]))
    assert code == 0 and again["fits"] and again["per_gpu"]["required_bytes"] == combo["required_bytes"]
