"""Bad input, as a hostile or careless user gives it, over every command and model source: each gets one line on
stderr naming the problem, exit code 2, no traceback, nothing on stdout and nothing written (the profile cache
and the working directory stay empty). The table is docs/reliability.md's (bench/reliability.py writes it).

Runs in process (memplan.cli.main), so the ~100 cases take a few seconds.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from clirun import run_cli  # noqa: F401  (the other CLI tests import it from here)

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "vocab_size": 100, "intermediate_size": 128}


def _config(**change):
    return json.dumps({**LLAMA, **change})


def _safetensors(header, data=b""):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


#: files the cases refer to as {name}: name -> (relative path, content)
FILES = {
    "ta_compile": ("ta_compile.json", '{"torch_compile": true}'),
    "ds_bf16_true": ("ds_bf16_true.json", '{"zero_optimization": {"stage": 2}, "bf16": true}'),
    "ds_fp16_yes": ("ds_fp16_yes.json", '{"zero_optimization": {"stage": 2}, "fp16": "yes"}'),
    "ds_both": ("ds_both.json", '{"bf16": {"enabled": true}, "fp16": {"enabled": true}}'),
    "ds_enabled_maybe": ("ds_enabled_maybe.json", '{"bf16": {"enabled": "maybe"}}'),
    "ds_nan": ("ds_nan.json", '{"zero_optimization": {"stage": 2, "reduce_bucket_size": NaN}}'),
    "ds_inf": ("ds_inf.json", '{"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e400}}'),
    "ds_huge": ("ds_huge.json", '{"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e30}}'),
    "ds_str": ("ds_str.json", '{"zero_optimization": {"stage": 2, "reduce_bucket_size": "lots"}}'),
    "ds_frac": ("ds_frac.json", '{"zero_optimization": {"stage": 2, "reduce_bucket_size": 2.5}}'),
    "ds_stage7": ("ds_stage7.json", '{"zero_optimization": {"stage": 7}}'),
    "ds_stage_str": ("ds_stage_str.json", '{"zero_optimization": {"stage": "2"}}'),
    "ds_stage_bool": ("ds_stage_bool.json", '{"zero_optimization": {"stage": true}}'),
    "ds_zero_str": ("ds_zero_str.json", '{"zero_optimization": "yes"}'),
    "ds_list": ("ds_list.json", "[1, 2, 3]"),
    "ds_deep": ("ds_deep.json", "[" * 100_000 + "]" * 100_000),
    "ds_garbage": ("ds_garbage.json", bytes(range(256)) * 8),
    "ds_empty": ("ds_empty.json", ""),
    "ds_mb_neg": ("ds_mb_neg.json", '{"train_micro_batch_size_per_gpu": -3}'),
    "ds_mb_float": ("ds_mb_float.json", '{"train_micro_batch_size_per_gpu": 2.5}'),
    "ds_ga_bool": ("ds_ga_bool.json", '{"gradient_accumulation_steps": true}'),
    "ds_mics": ("ds_mics.json", '{"zero_optimization": {"stage": 3, "mics_shard_size": 8}}'),
    "ds_amp": ("ds_amp.json", '{"amp": {"enabled": true}, "zero_optimization": {"stage": 2}}'),
    "ds_cpu_offload_both": ("ds_cpu_offload_both.json", '{"zero_optimization": {"stage": 2, "cpu_offload": true, '
                            '"offload_optimizer": {"device": "cpu"}}}'),
    "ds_cpu_offload_str": ("ds_cpu_offload_str.json", '{"zero_optimization": {"stage": 2, "cpu_offload": "maybe"}}'),
    "ds_offload_str": ("ds_offload_str.json", '{"zero_optimization": {"stage": 3, "offload_optimizer": "cpu"}}'),
    "ds_offload_dev": ("ds_offload_dev.json",
                       '{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "tape"}}}'),
    "ds_pin_maybe": ("ds_pin_maybe.json", '{"zero_optimization": {"stage": 3, "offload_optimizer": '
                                          '{"device": "cpu", "pin_memory": "maybe"}}}'),
    "ds_overlap_maybe": ("ds_overlap_maybe.json", '{"zero_optimization": {"stage": 2, "overlap_comm": "maybe"}}'),
    "ds_offload_param_z2": ("ds_offload_param_z2.json",
                            '{"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}'),
    "ds_auto_unknown": ("ds_auto_unknown.json", '{"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}'),
    "m_100_3": ("m_100_3/config.json", _config(hidden_size=100, num_attention_heads=3)),
    "m_neg": ("m_neg/config.json", _config(num_hidden_layers=-1)),
    # a LlavaConfig saved without the class it trains as (no architectures): not a causal LM
    "m_llava": ("m_llava/config.json", '{"model_type": "llava", "vision_config": {"model_type": "clip_vision_model"}, '
                '"text_config": {"model_type": "llama"}}'),
    "m_zero": ("m_zero/config.json", _config(hidden_size=0)),
    "m_float": ("m_float/config.json", _config(hidden_size=64.5)),
    "m_vocab_str": ("m_vocab_str/config.json", _config(vocab_size="100")),
    "m_huge": ("m_huge/config.json", _config(num_hidden_layers=10**12)),
    "m_tie": ("m_tie/config.json", _config(tie_word_embeddings="yes")),
    "m_kv": ("m_kv/config.json", _config(num_attention_heads=4, num_key_value_heads=3)),
    "m_bool_layers": ("m_bool_layers/config.json", _config(num_hidden_layers=True)),
    "m_no_type": ("m_no_type/config.json", json.dumps({"hidden_size": 64})),
    "m_list": ("m_list/config.json", "[1, 2]"),
    "m_not_json": ("m_not_json/config.json", "{not json"),
    "m_empty": ("m_empty/config.json", ""),
    "m_deep": ("m_deep/config.json", "[" * 100_000 + "]" * 100_000),
    "m_binary": ("m_binary/config.json", bytes(range(256)) * 8),
    "m_unknown_type": ("m_unknown_type/config.json", _config(model_type="nosuchmodel")),
    "idx_up": ("idx_up/model.safetensors.index.json", '{"weight_map": {"a": "../../../../etc/passwd"}}'),
    "idx_abs": ("idx_abs/model.safetensors.index.json", '{"weight_map": {"a": "/etc/passwd"}}'),
    "idx_up_cfg": ("idx_up/config.json", _config()),
    "idx_abs_cfg": ("idx_abs/config.json", _config()),
    "st_negoff_cfg": ("st_negoff/config.json", _config()),
    "st_negoff": ("st_negoff/model.safetensors",
                  _safetensors({"a": {"dtype": "BF16", "shape": [10], "data_offsets": [-8, 12]}}, b"\0" * 20)),
    "st_overlap_cfg": ("st_overlap/config.json", _config()),
    "st_overlap": ("st_overlap/model.safetensors",
                   _safetensors({"a": {"dtype": "BF16", "shape": [10], "data_offsets": [0, 20]},
                                 "b": {"dtype": "BF16", "shape": [10], "data_offsets": [10, 30]}}, b"\0" * 40)),
    "st_hugedim_cfg": ("st_hugedim/config.json", _config()),
    "st_hugedim": ("st_hugedim/model.safetensors",
                   _safetensors({"a": {"dtype": "BF16", "shape": [10**30], "data_offsets": [0, 20]}}, b"\0" * 20)),
    "st_dtypelist_cfg": ("st_dtypelist/config.json", _config()),
    "st_dtypelist": ("st_dtypelist/model.safetensors",
                     _safetensors({"a": {"dtype": ["BF16"], "shape": [10], "data_offsets": [0, 20]}}, b"\0" * 20)),
    "st_deep_cfg": ("st_deep/config.json", _config()),
    "st_deep": ("st_deep/model.safetensors", _safetensors(b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")),
    "st_len_cfg": ("st_len/config.json", _config()),
    "st_len": ("st_len/model.safetensors", struct.pack("<Q", 1 << 60)),
    "st_short_cfg": ("st_short/config.json", _config()),
    "st_short": ("st_short/model.safetensors", b"\x01\x02"),
    "st_past_cfg": ("st_past/config.json", _config()),
    "st_past": ("st_past/model.safetensors",
                _safetensors({"a": {"dtype": "BF16", "shape": [10], "data_offsets": [0, 20]}}, b"\0" * 4)),
    "st_size_cfg": ("st_size/config.json", _config()),
    "st_size": ("st_size/model.safetensors",
                _safetensors({"a": {"dtype": "BF16", "shape": [10], "data_offsets": [0, 40]}}, b"\0" * 40)),
    "st_garbage_cfg": ("st_garbage/config.json", _config()),
    "st_garbage": ("st_garbage/model.safetensors", _safetensors(b"\xff\xfe garbage")),
    # PEFT adapter configs
    "ad_dora": ("ad_dora/adapter_config.json", '{"peft_type": "LORA", "r": 8, "use_dora": true}'),
    "ad_ia3": ("ad_ia3.json", '{"peft_type": "IA3", "target_modules": ["k_proj"]}'),
    "ad_broken": ("ad_broken.json", '{"peft_type": "LORA",\n "r": 8,'),
    "ad_r": ("ad_r.json", '{"peft_type": "LORA", "r": -4}'),
    "ad_targets": ("ad_targets.json", '{"peft_type": "LORA", "r": 8, "target_modules": {"q": 1}}'),
    "ad_list": ("ad_list.json", '[1, 2]'),
}

#: (arguments with {dir} for the files' directory, what the one line must name)
CASES = [
    ("estimate {dir}/m_llava", "--task image-text-to-text"),
    # ZeRO++ qwZ: a partition DeepSpeed's quantizer asserts on (43,690,667 elements: the embedding over 3 ranks)
    ("estimate llama-7b --gpus 3 --gpus-per-node 3 --stage 3 --zero-quantized-weights", "cannot be quantized"),
    # --compile (memplan/activations/tracing/compiled.py): what it does not model
    ("estimate llama-7b --compile model", "unknown --compile"),
    ("estimate llama-7b --compile blocks --activations analytic", "needs the traced activations"),
    ("estimate llama-7b --compile blocks --gpus 2 --tp 2", "--tp/--pp/--cp/--ep"),
    ("estimate llama-7b --compile blocks --gpus 2 --stage 2", "under deepspeed is not modelled"),
    ("estimate llama-7b --compile blocks --lora-rank 8 --quantize-base nf4", "with a 4-bit base"),
    ("estimate llama-7b --compile blocks --attention eager", "with --attention eager"),
    ("estimate llama-7b --gpus 2 --strategy fsdp-full --recompute full --lora-rank 8 --compile blocks",
     "with LoRA under FSDP2 and recompute"),
    ("estimate llama-7b --training-args {dir}/ta_compile.json", "torch_compile (the whole model in one graph)"),
    # float8 training (--precision fp8-*: torchao's Float8Linear, memplan/activations/tracing/float8.py)
    ("estimate llama-7b --precision fp8-tensorwise --gpu a100-80g", "needs float8 tensor cores"),
    ("estimate llama-7b --precision fp8 --gpu v100-32g", "not sm70"),
    ("estimate llama-7b --precision fp8-rowwise --gpus 2 --stage 3", "not under DeepSpeed"),
    ("estimate llama-7b --precision fp8-rowwise --activations analytic", "needs the traced activations"),
    ("estimate llama-7b --precision fp8-rowwise --lora-rank 8", "with LoRA is not modelled"),
    ("estimate llama-7b --precision fp8-rowwise --gpus 2 --strategy fsdp-full --tp 2", "--tp/--pp/--cp/--ep"),
    ("estimate llama-7b --precision fp9", "unknown precision recipe"),
    ("estimate llama-7b --precision mxfp8 --gpu b200-180g", "MX formats (MXLinear, Blackwell) are not modelled"),
    ("estimate llama-7b --float8-all-gather --gpus 2 --strategy fsdp-full", "--float8-all-gather applies to float8"),
    ("estimate llama-7b --precision fp8-rowwise --float8-all-gather --gpus 2 --strategy fsdp-full",
     "modelled under FSDP2 with tensorwise scaling and fsdp-bf16"),
    ("estimate llama-7b --precision fp8 --float8-all-gather --gpus 2 --strategy ddp",
     "modelled under FSDP2 with tensorwise scaling and fsdp-bf16"),
    ("estimate llama-7b --precision fp8 --float8-all-gather --gpus 2 --strategy fsdp-no-shard",
     "needs a shard group of more than one rank"),
    ("estimate llama-7b --precision fp8 --gpus 2 --strategy fsdp-full --fsdp-version 1", "not under DeepSpeed, Horovod or FSDP1"),
    ("estimate llama-7b --float8 fp8", "unknown --float8"),
    ("estimate llama-7b --float8 rowwise --precision fp32", "float8 training computes in bf16"),
    ("estimate llama-7b --float8 rowwise --precision fp8-tensorwise", "two float8 recipes"),
    ("estimate llama-7b --float8-keep first-last", "--float8-keep applies to float8 training"),
    ("estimate llama-7b --float8 rowwise --float8-keep last", "unknown --float8-keep"),
    # DeepSpeed configs: wrong types, NaN and infinity, unbounded and binary input
    ("estimate gpt2 --deepspeed {dir}/ds_bf16_true.json", '"bf16" must be an object'),
    ("estimate gpt2 --deepspeed {dir}/ds_fp16_yes.json", '"fp16" must be an object'),
    ("estimate gpt2 --deepspeed {dir}/ds_both.json", "bf16 and fp16 are both enabled"),
    ("estimate gpt2 --deepspeed {dir}/ds_enabled_maybe.json", "bf16.enabled must be true or false"),
    ("estimate gpt2 --deepspeed {dir}/ds_nan.json", "reduce_bucket_size must be a non-negative integer"),
    ("estimate gpt2 --deepspeed {dir}/ds_inf.json", "reduce_bucket_size must be a non-negative integer"),
    ("estimate gpt2 --deepspeed {dir}/ds_huge.json", "reduce_bucket_size must be a non-negative integer"),
    ("estimate gpt2 --deepspeed {dir}/ds_str.json", "reduce_bucket_size must be a non-negative integer"),
    ("estimate gpt2 --deepspeed {dir}/ds_frac.json", "reduce_bucket_size must be a non-negative integer"),
    ("estimate gpt2 --deepspeed {dir}/ds_stage7.json", "stage must be 0, 1, 2 or 3"),
    ("estimate gpt2 --deepspeed {dir}/ds_stage_str.json", "stage must be 0, 1, 2 or 3"),
    ("estimate gpt2 --deepspeed {dir}/ds_stage_bool.json", "stage must be 0, 1, 2 or 3"),
    ("estimate gpt2 --deepspeed {dir}/ds_zero_str.json", "zero_optimization must be an object"),
    ("estimate gpt2 --deepspeed {dir}/ds_list.json", "must hold a JSON object"),
    ("estimate gpt2 --deepspeed {dir}/ds_deep.json", "nested too deeply"),
    ("estimate gpt2 --deepspeed {dir}/ds_garbage.json", "DeepSpeed config"),
    ("estimate gpt2 --deepspeed {dir}/ds_empty.json", "is not valid JSON"),
    ("estimate gpt2 --deepspeed {dir}/ds_mb_neg.json", "train_micro_batch_size_per_gpu must be"),
    ("estimate gpt2 --deepspeed {dir}/ds_mb_float.json", "train_micro_batch_size_per_gpu must be"),
    ("estimate gpt2 --deepspeed {dir}/ds_ga_bool.json", "gradient_accumulation_steps must be"),
    ("estimate gpt2 --gpus 8 --deepspeed {dir}/ds_mics.json", "refuses zero_optimization.mics_shard_size"),
    ("estimate gpt2 --gpus 8 --deepspeed {dir}/ds_amp.json", "refuses amp"),
    ("estimate gpt2 --gpus 8 --deepspeed {dir}/ds_cpu_offload_both.json", "cpu_offload and offload_optimizer"),
    ("estimate gpt2 --gpus 8 --deepspeed {dir}/ds_cpu_offload_str.json", "cpu_offload must be true or false"),
    ("estimate gpt2 --deepspeed {dir}/ds_offload_str.json", "offload_optimizer must be an object"),
    ("estimate gpt2 --deepspeed {dir}/ds_offload_dev.json", "device must be cpu, nvme or none"),
    ("estimate gpt2 --deepspeed {dir}/ds_pin_maybe.json", "pin_memory must be true or false"),
    ("estimate gpt2 --deepspeed {dir}/ds_overlap_maybe.json", "overlap_comm must be true or false"),
    ("estimate gpt2 --deepspeed {dir}/ds_offload_param_z2.json", "needs ZeRO stage 3"),
    ("estimate gpt2 --deepspeed {dir}/ds_auto_unknown.json", '"auto" is not resolvable for sub_group_size'),
    ("estimate gpt2 --deepspeed {dir}/fifo.json", "is not a regular file"),
    ("estimate gpt2 --deepspeed /dev/zero", "is not a regular file"),
    ("estimate gpt2 --deepspeed {dir}", "is not a regular file"),
    ("estimate gpt2 --deepspeed {dir}/missing.json", "No such file or directory"),
    # model configs: every builder validates the same way
    ("estimate {dir}/m_100_3", "hidden size (100) is not a multiple of the number of attention heads (3)"),
    ("estimate {dir}/m_100_3 --builder meta", "hidden size (100) is not a multiple"),
    ("estimate {dir}/m_neg", "'num_hidden_layers' must be a positive integer"),
    ("estimate {dir}/m_neg --builder meta", "'num_hidden_layers' must be a positive integer"),
    ("estimate {dir}/m_zero", "'hidden_size' must be a positive integer"),
    ("estimate {dir}/m_float", "'hidden_size' must be a positive integer"),
    ("estimate {dir}/m_vocab_str", "'vocab_size' must be a positive integer"),
    ("estimate {dir}/m_huge", "more than any model memplan can size"),
    ("estimate {dir}/m_tie", "'tie_word_embeddings' must be true or false"),
    ("estimate {dir}/m_kv", "num_key_value_heads (3) must divide num_attention_heads (4)"),
    ("estimate {dir}/m_bool_layers", "'num_hidden_layers' must be a positive integer"),
    ("estimate {dir}/m_no_type", "no 'model_type' field"),
    ("estimate {dir}/m_list", "JSON object"),
    ("estimate {dir}/m_not_json", "not valid JSON"),
    ("estimate {dir}/m_empty", "is empty"),
    ("estimate {dir}/m_deep", "config"),
    ("estimate {dir}/m_binary", "config"),
    ("inspect {dir}/m_unknown_type --builder analytic", "no analytic builder"),
    ("estimate {dir}/fifo.json", "is not a regular file or a directory"),
    ("inspect /dev/zero", "is not a regular file or a directory"),
    ("estimate nosuchmodel", "unknown preset 'nosuchmodel'"),
    ("inspect {dir}/idx_up", "is not a file inside"),
    ("inspect {dir}/idx_abs", "is not a file inside"),
    # safetensors headers, validated as the safetensors library validates them
    ("inspect {dir}/st_negoff", "data_offsets"),
    ("inspect {dir}/st_overlap", "overlaps another"),
    ("inspect {dir}/st_hugedim", "invalid shape"),
    ("inspect {dir}/st_dtypelist", "unknown dtype"),
    ("inspect {dir}/st_deep", "nested too deeply"),
    ("inspect {dir}/st_len", "header length exceeds"),
    ("inspect {dir}/st_short", "too short to be a safetensors file"),
    ("inspect {dir}/st_past", "data_offsets"),
    ("inspect {dir}/st_size", "data_offsets"),
    ("inspect {dir}/st_garbage", "not valid JSON"),
    # absurd or contradictory options
    ("estimate gpt2 --gpus 1000000000000000000000000000000", "more than the 1,048,576 GPUs"),
    ("estimate gpt2 --gpus 0", "--gpus must be at least 1"),
    ("estimate gpt2 --strategy single --gpus 4", "runs on one GPU, not 4"),
    ("estimate gpt2 --gpus 8 --strategy hsdp --hsdp-shard-size 0", "--hsdp-shard-size must be at least 1"),
    ("estimate gpt2 --gpus 24 --gpus-per-node 16", "gpus(24) is not a multiple of gpus_per_node(16)"),
    ("estimate gpt2 --gpus 2048 --gpus-per-node 2048", "GPUs any node holds"),
    ("estimate gpt2 --micro-batch 100000000000", "micro-batch 100,000,000,000 is more than"),
    ("estimate gpt2 --seq-len 10000000000", "seq-len 10,000,000,000 is more than"),
    ("estimate gpt2 --grad-accum 0", "grad-accum must be at least 1"),
    ("estimate gpt2 --gpu-memory 80", "has no unit"),
    ("estimate gpt2 --gpu-memory 80G", "is ambiguous"),
    ("estimate gpt2 --gpu-memory nanGB", "memory size"),
    ("estimate gpt2 --gpu-memory infGiB", "memory size"),
    ("estimate gpt2 --gpu h900", "unknown GPU 'h900'"),
    ("estimate gpt2 --recompute some", "unknown recompute 'some'"),
    ("estimate gpt2 --attention ring", "unknown attention 'ring'"),
    ("estimate gpt2 --device tpu", "--device must be cuda or cpu"),
    ("estimate gpt2 --optimizer-impl magic", "unknown optimizer implementation 'magic'"),
    ("estimate gpt2 --stage 2 --strategy ddp", "give --stage or --strategy, not both"),
    ("estimate gpt2 --strategy fsdp-full --fsdp-version 3", "--fsdp-version must be 1 or 2"),
    ("estimate gpt2 --strategy fsdp-full --reshard-after-forward maybe", "--reshard-after-forward must be"),
    ("estimate gpt2 --strategy fsdp-full --reshard-after-forward 0", "group size must be positive"),
    ("estimate gpt2 --strategy fsdp-full --gpus 4 --reshard-after-forward 3", "must divide the shard group"),
    ("estimate gpt2 --strategy fsdp-full --fsdp-version 1 --reshard-after-forward 2", "group sizes are FSDP2's"),
    ("estimate gpt2 --bucket-cap-mb 0", "--bucket-cap-mb must be positive"),
    ("estimate gpt2 --cuda-context -1GB", "--cuda-context"),
    ("estimate gpt2 --fragmentation-percent -5", "fragmentation-percent must not be negative"),
    ("estimate gpt2 --allocator-conf max_split_size_mb:1_000", "max_split_size_mb too small"),
    ("estimate gpt2 --strategy fsdp-full --gpus 2 --fsdp-root-reshard sometimes", "--fsdp-root-reshard"),
    ("estimate gpt2 --stage 3 --offload-optimizer --host-memory abc", "memory size"),
    ("estimate gpt2 --stage 3 --reduce-bucket-size -5", "reduce-bucket-size must not be negative"),
    ("estimate gpt2 --stage 3 --hpz-partition-size 0", "zero_hpz_partition_size must be at least 1"),
    ("estimate gpt2 --stage 3 --gpus 6 --hpz-partition-size 4", "not a multiple of zero_hpz_partition_size"),
    ("estimate gpt2 --builder magic", "unknown builder 'magic'"),
    ("estimate gpt2 --activations maybe", "--activations must be auto, traced or analytic"),
    ("estimate gpt2 --unknown-option 3", "No such option: --unknown-option"),
    ("estimate gpt2 --gpus abc", "Invalid value for '--gpus'"),
    ("estimate", "Missing argument"),
    ("nosuchcommand", "No such command"),
    ("presets --bogus", "No such option: --bogus"),
    ("plan gpt2", "plan needs the GPU"),
    ("plan gpt2 --gpu h100-80g --max-gpus 1000000000", "more than the 1,048,576 GPUs"),
    ("plan gpt2 --gpu h100-80g --max-micro-batch 1000000", "more than the 4,096"),
    ("plan gpt2 --gpu h100-80g --min-headroom 1.5", "between 0 and 1"),
    ("estimate gpt2 --gpus 2 --strategy horovod --horovod-compression zip", "none or fp16"),
    ("estimate gpt2 --gpus 2 --strategy ddp --horovod-compression fp16", "Horovod's"),
    ("estimate gpt2 --gpus 2 --strategy horovod --horovod-fusion-threshold 64", "has no unit"),
    ("plan gpt2 --gpu h100-80g --min-headroom nan", "between 0 and 1"),
    ("plan gpt2 --gpu h100-80g --min-headroom 100%", "between 0 and 1"),
    ("plan gpt2 --gpu h100-80g --min-headroom 90GiB", "not less than the GPU"),
    ("plan gpt2 --gpu h100-80g --min-headroom 8G", "ambiguous"),
    ("plan gpt2 --gpu h100-80g --strategies foo", "unknown strategy 'foo'"),
    ("plan gpt2 --gpu h100-80g --gpus-per-node 0", "--gpus-per-node must be at least 1"),
    ("validate gpt2 --device cpu --timeout nan", "--timeout must be a positive number"),
    ("validate gpt2 --device cpu --timeout inf", "--timeout must be a positive number"),
    ("validate gpt2 --device cpu --tolerance nan", "--tolerance must be a positive number"),
    ("validate gpt2 --device cpu --layers 2 --hidden 63", "--hidden 63"),
    ("validate gpt2 --device cpu --layers 0", "--layers must be at least 1"),
    # LoRA: what PEFT itself refuses, and what memplan does not model
    ("estimate llama-3-8b --lora-rank 8 --lora-targets nope_proj", "match no linear layer"),
    ("estimate llama-3-8b --lora-rank 8 --lora-targets embed_tokens", "is an embedding"),
    ("estimate llama-3-8b --lora-rank 0", "--lora-rank must be at least 1"),
    ("estimate llama-3-8b --lora-rank 8 --lora-alpha nan", "--lora-alpha must be a positive number"),
    ("estimate llama-3-8b --lora-rank 8 --lora-dropout 1.5", "LoRA dropout must be in [0, 1)"),
    ("estimate llama-3-8b --lora-targets q_proj", "without --lora-rank"),
    ("estimate llama-3-8b --lora-rank 8 --lora-targets ,", "--lora-targets is empty"),
    ("estimate mixtral-8x7b --lora-rank 8", "no default LoRA targets for mixtral"),
    ("estimate mixtral-8x7b --lora-rank 8 --lora-targets q_proj,w1", "without also w3"),
    ("estimate mixtral-8x7b --lora-rank 8 --lora-targets all-linear --lora-dropout 0.05", "lora_dropout"),
    # FSDP1 under PEFT's units: MixedPrecision (fsdp-bf16, its default recipe) needs autocast beside it
    ("estimate llama-3-8b --lora-rank 8 --gpus 8 --strategy fsdp-full --fsdp-version 1",
     "--precision fsdp-bf16 with LoRA under FSDP1"),
    ("estimate llama-3-8b --lora-rank 8 --gpus 8 --strategy fsdp-full --fsdp-version 1 --precision pure-bf16 "
     "--quantize-base nf4", "uint8 storage"),
    ("estimate llama-3-8b --lora-rank 8 --gpus 8 --strategy fsdp-full --fsdp-version 1 --precision fp32 "
     "--fsdp-wrap size:1000000", "fsdp_auto_wrap_policy"),
    ("estimate llama-3-8b --freeze model.embed_tokens --gpus 8 --strategy fsdp-full --fsdp-version 1",
     "holds frozen model.embed_tokens.weight beside trainable"),
    ("estimate llama-3-8b --lora-rank 8 --quantize-base int8", "int8 (bitsandbytes LLM.int8"),
    ("estimate llama-3-8b --gpus 8 --strategy fsdp-full --fsdp-wrap blocks",
     "--fsdp-wrap must be one of block, block+embeddings, none"),
    ("estimate gpt2 --gpus 2 --strategy fsdp-full --fsdp-wrap block+embeddings", "ties its input and output"),
    ("estimate llama-3-8b --gpus 8 --stage 2 --fsdp-wrap block+embeddings", "is for FSDP2"),
    ("estimate llama-3-8b --gpus 8 --stage 3 --z3-leaf-modules ,", "--z3-leaf-modules is empty"),
    ("estimate llama-3-8b --gpus 8 --stage 3 --z3-leaf-modules NopeBlock", "no module of class NopeBlock"),
    ("estimate llama-3-8b --gpus 8 --strategy fsdp-full --z3-leaf-modules LlamaMLP", "is DeepSpeed ZeRO-3's"),
    ("estimate llama-3-8b --gpus 8 --stage 3 --fsdp-wrap none", "--fsdp-wrap none is for FSDP, not zero3"),
    ("estimate llama-3-8b --gpus 8 --strategy fsdp-full --fsdp-version 1 --fsdp-wrap block+embeddings",
     "is for FSDP2 (--strategy fsdp-*, hsdp), not fsdp-full with --fsdp-version 1"),
    ("estimate llama-3-8b --lora-rank 8 --quantize-base nf3", "--quantize-base must be nf4 or fp4"),
    ("estimate llama-3-8b --quantize-base nf4", "without --lora-rank"),
    ("estimate llama-3-8b --lora-rank 8 --double-quant", "--double-quant quantizes a 4-bit base"),
    ("estimate llama-3-8b --lora-rank 8 --quantize-base nf4 --quant-compute-dtype int4", "--quant-compute-dtype must be"),
    ("estimate llama-3-8b --lora-rank 8 --quantize-base nf4 --gpus 8 --strategy fsdp-full --quant-storage bf16",
     "stored float32 by this recipe"),
    ("estimate llama-3-8b --lora-rank 8 --quantize-base nf4 --gpus 8 --strategy fsdp-full --quant-storage fp32",
     "MixedPrecisionPolicy"),
    ("estimate llama-3-8b --lora-rank 8 --quantize-base nf4 --gpus 8 --stage 3", "zero3 with a uint8 storage"),
    ("estimate llama-3-8b --lora-rank 8 --quantize-base nf4 --quant-storage int4", "--quant-storage must be"),
    ("estimate llama-3-8b --lora-rank 8 --quant-storage bf16", "--quantize-base"),
    ("estimate llama-3-8b --quant-storage bf16", "without --lora-rank"),
    ("estimate llama-3-8b --lora-rank 8 --quantize-base nf4 --lora-targets lm_head --adapter-config x.json",
     "x.json"),
    ("estimate llama-3-8b --adapter-config {dir}/ad_dora", "DoRA"),
    ("estimate llama-3-8b --adapter-config {dir}/ad_ia3.json", "peft_type IA3 is not modelled"),
    ("estimate llama-3-8b --adapter-config {dir}/ad_broken.json", "not valid JSON: Expecting property name enclosed in double quotes at line 2 column 9"),
    ("estimate llama-3-8b --adapter-config {dir}/ad_r.json", "at least 1"),
    ("estimate llama-3-8b --adapter-config {dir}/ad_targets.json", "target_modules must be"),
    ("estimate llama-3-8b --adapter-config {dir}/ad_list.json", "an adapter config is a JSON object"),
    ("estimate llama-3-8b --adapter-config {dir}/missing.json", "cannot read adapter config"),
    ("plan llama-3-8b --gpu h100-80g --lora-rank 8 --lora-targets nope_proj", "match no linear layer"),
]


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    for rel, content in FILES.values():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    os.mkfifo(d / "fifo.json")
    return d


def test_the_table_is_large_enough():
    assert len(CASES) >= 80


@pytest.mark.parametrize("args,needle", CASES, ids=[c[0][:60] for c in CASES])
def test_bad_input(args, needle, bad_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(cache))
    monkeypatch.chdir(work)
    code, out, err = run_cli([a.format(dir=bad_dir) for a in args.split()])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert needle in lines[0], lines[0]
    assert "Traceback" not in err and "root:" not in err
    assert out == ""
    assert not cache.exists() or not any(cache.rglob("*")), list(cache.rglob("*"))  # nothing cached
    assert not any(Path(work).iterdir())  # nothing written where it ran


def test_plan_skips_the_strategies_a_job_cannot_run():
    # QLoRA with its default uint8 storage cannot run under ZeRO-3 (DeepSpeed partitions every parameter): plan
    # leaves it out with a note instead of failing; FSDP2 keeps the 4-bit weights whole (Accelerate's
    # ignored_params) and is considered
    code, out, err = run_cli(["plan", "llama-3-8b", "--gpu", "h100-80g", "--lora-rank", "16", "--quantize-base", "nf4",
                              "--max-gpus", "2", "--json"])
    assert code in (0, 1), err
    rep = json.loads(out)
    text = json.dumps(rep)
    assert "zero3 not considered" in text and "fsdp-full not considered" not in text
