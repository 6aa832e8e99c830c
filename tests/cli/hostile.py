"""Hostile input on every surface a user reaches (issue 41): job files (TrainingArguments, Accelerate configs, PEFT
adapter configs, ds_config), allocator settings (--allocator-conf and the environment), --plot, shell completion,
the user's factories, --fsdp-wrap, --z3-leaf-modules, the LoRA options, the parallel options, the Hugging Face
cache, config.json, numbers and the output's encoding. tests/cli/test_hostile_inputs.py runs it in the quick suite
(the factories' slow ones aside); bench/reliability.py runs it, with tests/cli/test_bad_inputs.py's table, for
docs/reliability.md.

A case: the command (``{dir}`` is the directory of the files below), what its one error line must contain, the
environment it runs with, the exit code it must give (2: refused, one line, nothing on stdout, nothing written;
0 or 1: a job that runs, whose verdict the input decides) and its surface.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Case:
    args: str
    needle: str
    surface: str
    env: dict = field(default_factory=dict)
    expect: int = 2
    #: runs in a fresh interpreter (an environment read at start, an encoding), or takes seconds (factories)
    subprocess: bool = False
    slow: bool = False


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "vocab_size": 100, "intermediate_size": 128}


def _bomb(levels: int, width: int, key: str) -> str:
    lines = ['a0: &a0 [' + ",".join(['"x"'] * width) + ']']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]")
    lines.append(f"{key}: *a{levels - 1}")
    return "\n".join(lines) + "\n"


def _deep_yaml(depth: int) -> str:
    return "x: " + "[" * depth + "]" * depth + "\n"


BIG_INT = "9" * 5000

#: name -> (relative path, content): bytes, text, or ("link", target) / ("fifo",) / ("dir",)
FILES: dict[str, tuple[str, object]] = {
    # TrainingArguments
    "ta_bomb": ("ta_bomb.yaml", _bomb(9, 9, "per_device_train_batch_size")),
    "ta_bomb_wide": ("ta_bomb_wide.yaml", _bomb(4, 60, "optim")),
    "ta_bomb_nested": ("ta_bomb_nested.yaml", _bomb(6, 10, "fsdp_config")),
    "ta_bomb_kwargs": ("ta_bomb_kwargs.yaml", "gradient_checkpointing: true\n" + _bomb(8, 10,
                                                                                         "gradient_checkpointing_kwargs")),
    "ta_recursive": ("ta_recursive.yaml", "a: &a [1, *a]\n"),
    "ta_python_tag": ("ta_python_tag.yaml", "optim: !!python/object/apply:os.system ['true']\n"),
    "ta_python_name": ("ta_python_name.yaml", "optim: !!python/name:os.system\n"),
    "ta_bigint_yaml": ("ta_bigint.yaml", f"per_device_train_batch_size: {BIG_INT}\n"),
    "ta_bigint_ignored": ("ta_bigint_ignored.json", f'{{"unused_key": {BIG_INT}}}'),
    "ta_bigint_neg": ("ta_bigint_neg.json", f'{{"seed": -{BIG_INT}}}'),
    "ta_intkey": ("ta_intkey.yaml", "1: 2\nbf16: true\n"),
    "ta_boolkey": ("ta_boolkey.yaml", "true: 1\n"),
    "ta_nullkey": ("ta_nullkey.yaml", "? null\n: 1\n"),
    "ta_deep_yaml": ("ta_deep.yaml", _deep_yaml(100_000)),
    "ta_deep_json": ("ta_deep.json", "[" * 100_000 + "]" * 100_000),
    "ta_deep_65": ("ta_deep_65.json", '{"x": ' + "[" * 70 + "]" * 70 + "}"),
    "ta_kwargs_deep": ("ta_kwargs_deep.json", json.dumps({"gradient_checkpointing": True,
                                                          "gradient_checkpointing_kwargs": "[" * 100_000})),
    "ta_kwargs_str": ("ta_kwargs_str.json", json.dumps({"gradient_checkpointing": True,
                                                        "gradient_checkpointing_kwargs": "{not json"})),
    "ta_kwargs_list": ("ta_kwargs_list.json", json.dumps({"gradient_checkpointing": True,
                                                         "gradient_checkpointing_kwargs": [1, 2]})),
    "ta_every_str": ("ta_every_str.json", json.dumps({"gradient_checkpointing": True,
                                                      "gradient_checkpointing_kwargs": {"every_n_layers": "2"}})),
    "ta_not_utf8": ("ta_not_utf8.json", b'{"optim": "\xff\xfe"}'),
    "ta_list": ("ta_list.json", "[1, 2]"),
    "ta_scalar": ("ta_scalar.yaml", "42\n"),
    "ta_empty": ("ta_empty.yaml", ""),
    "ta_bad_yaml": ("ta_bad.yaml", "a: [1, 2\n"),
    "ta_tab_yaml": ("ta_tab.yaml", "a:\n\t- 1\n"),
    "ta_dup": ("ta_dup.json", '{"bf16": true, "fp16": true}'),
    "ta_mb_zero": ("ta_mb_zero.json", '{"per_device_train_batch_size": 0}'),
    "ta_mb_float": ("ta_mb_float.json", '{"per_device_train_batch_size": 2.5}'),
    "ta_mb_str": ("ta_mb_str.json", '{"per_device_train_batch_size": "eight"}'),
    "ta_mb_nan": ("ta_mb_nan.json", '{"per_device_train_batch_size": NaN}'),
    "ta_mb_inf": ("ta_mb_inf.json", '{"per_device_train_batch_size": 1e400}'),
    "ta_ga_neg": ("ta_ga_neg.json", '{"gradient_accumulation_steps": -1}'),
    "ta_bf16_str": ("ta_bf16_str.json", '{"bf16": "sometimes"}'),
    "ta_optim_int": ("ta_optim_int.json", '{"optim": 7}'),
    "ta_optim_unknown": ("ta_optim_unknown.json", '{"optim": "adamw_quantum"}'),
    "ta_optim_long": ("ta_optim_long.json", json.dumps({"optim": "x" * 100_000})),
    "ta_fsdp_ints": ("ta_fsdp_ints.json", '{"fsdp": [1, 2]}'),
    "ta_fsdp_bogus": ("ta_fsdp_bogus.json", '{"fsdp": "full_shard turbo"}'),
    "ta_fsdp_cfg_list": ("ta_fsdp_cfg_list.json", '{"fsdp": "full_shard", "fsdp_config": [1]}'),
    "ta_fsdp_cfg_missing": ("ta_fsdp_cfg_missing.json", '{"fsdp": "full_shard", "fsdp_config": "nope.json"}'),
    "ta_fsdp_version": ("ta_fsdp_version.json", '{"fsdp": "full_shard", "fsdp_config": {"version": 3}}'),
    "ta_fsdp_version_str": ("ta_fsdp_version_str.json", '{"fsdp": "full_shard", "fsdp_config": {"version": "x"}}'),
    "ta_fsdp_and_ds": ("ta_fsdp_and_ds.json", '{"fsdp": "full_shard", "deepspeed": "ds.json"}'),
    "ta_ds_dict": ("ta_ds_dict.json", '{"deepspeed": {"zero_optimization": {"stage": 2}}}'),
    "ta_ds_list_file": ("ta_ds_list_file.json", '{"deepspeed": "ds_list.json"}'),
    "ds_list": ("ds_list.json", "[1, 2]"),
    "ta_ds_fifo": ("ta_ds_fifo.json", '{"deepspeed": "fifo.json"}'),
    "ta_ds_devzero": ("ta_ds_devzero.json", '{"deepspeed": "/dev/zero"}'),
    "ta_ds_mismatch": ("ta_ds_mismatch.json", '{"deepspeed": "ds_mb4.json", "per_device_train_batch_size": 2}'),
    "ds_mb4": ("ds_mb4.json", '{"train_micro_batch_size_per_gpu": 4}'),
    "ta_wrap_cls_int": ("ta_wrap_cls_int.json", '{"fsdp": "full_shard", "fsdp_config": '
                                                '{"transformer_layer_cls_to_wrap": [1]}}'),
    "ta_wrap_policy": ("ta_wrap_policy.json", '{"fsdp": "full_shard", "fsdp_config": {"auto_wrap_policy": "MAGIC"}}'),
    "ta_big": ("ta_big.json", ("sparse", 17 << 20)),
    # Accelerate configs
    "acc_bomb": ("acc_bomb.yaml", _bomb(9, 9, "num_processes")),
    "acc_bomb_fsdp": ("acc_bomb_fsdp.yaml", "distributed_type: FSDP\n" + _bomb(7, 9, "fsdp_config")),
    "acc_recursive": ("acc_recursive.yaml", "fsdp_config: &a {x: *a}\ndistributed_type: FSDP\n"),
    "acc_tag": ("acc_tag.yaml", "distributed_type: !!python/object/new:os.system ['true']\n"),
    "acc_fsdp_list": ("acc_fsdp_list.yaml", "distributed_type: FSDP\nfsdp_config: [1, 2]\n"),
    "acc_fsdp_str": ("acc_fsdp_str.yaml", "distributed_type: FSDP\nfsdp_config: abc\n"),
    "acc_fsdp_int": ("acc_fsdp_int.yaml", "distributed_type: FSDP\nfsdp_config: 3\n"),
    "acc_fv_abc": ("acc_fv_abc.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: abc\n"),
    "acc_fv_null": ("acc_fv_null.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: null\n"),
    "acc_fv_list": ("acc_fv_list.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: [2]\n"),
    "acc_fv_sup": ("acc_fv_sup.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: '\u00b2'\n"),
    "acc_fv_float": ("acc_fv_float.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2.5\n"),
    "acc_fv_3": ("acc_fv_3.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 3\n"),
    "acc_fv_true": ("acc_fv_true.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: true\n"),
    "acc_intkey": ("acc_intkey.yaml", "1: 2\ndistributed_type: MULTI_GPU\n"),
    "acc_intkey_nested": ("acc_intkey_nested.yaml", "distributed_type: FSDP\nfsdp_config:\n  7: 2\n"),
    "acc_ds_list": ("acc_ds_list.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config: [1, 2]\n"),
    "acc_ds_str": ("acc_ds_str.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config: zero3\n"),
    "acc_ds_stage": ("acc_ds_stage.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 9\n"),
    "acc_ds_file_fifo": ("acc_ds_file_fifo.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                                  "  deepspeed_config_file: fifo.json\n"),
    "acc_ds_off_dev": ("acc_ds_off_dev.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                              "  offload_optimizer_device: tape\n"),
    "acc_pc_list": ("acc_pc_list.yaml", "distributed_type: FSDP\nparallelism_config: [1]\n"),
    "acc_pc_tp": ("acc_pc_tp.yaml", "distributed_type: FSDP\nparallelism_config:\n  tp_size: -2\n"),
    "acc_procs": ("acc_procs.yaml", "distributed_type: MULTI_GPU\nnum_processes: 0\n"),
    "acc_procs_str": ("acc_procs_str.yaml", "distributed_type: MULTI_GPU\nnum_processes: many\n"),
    "acc_machines": ("acc_machines.yaml", "distributed_type: MULTI_GPU\nnum_processes: 6\nnum_machines: 4\n"),
    "acc_mixed": ("acc_mixed.yaml", "mixed_precision: fp64\n"),
    "acc_dist": ("acc_dist.yaml", "distributed_type: TPU\n"),
    "acc_sharding": ("acc_sharding.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n"
                                          "  fsdp_sharding_strategy: 9\n"),
    "acc_bigint": ("acc_bigint.yaml", f"num_processes: {BIG_INT}\n"),
    "acc_ok_fsdp": ("acc_ok_fsdp.yaml", "distributed_type: FSDP\nnum_processes: 8\nmixed_precision: bf16\n"
                                        "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: "
                                        "TRANSFORMER_BASED_WRAP\n"),
    # PEFT adapter configs
    "ad_zero_dir": ("ad_zero/adapter_config.json", ("link", "/dev/zero")),
    "ad_urandom_dir": ("ad_urandom/adapter_config.json", ("link", "/dev/urandom")),
    "ad_fifo": ("ad_fifo.json", ("fifo",)),
    "ad_dir_fifo": ("ad_dir_fifo/adapter_config.json", ("fifo",)),
    "ad_dir_empty": ("ad_dir_empty", ("dir",)),
    "ad_big": ("ad_big.json", ("sparse", 17 << 20)),
    "ad_not_utf8": ("ad_not_utf8.json", b'{"r": 8, "target_modules": ["q_proj"], "x": "\xff\xfe"}'),
    "ad_bigint": ("ad_bigint.json", f'{{"r": {BIG_INT}}}'),
    "ad_bigint_ignored": ("ad_bigint_ignored.json", f'{{"r": 8, "revision": {BIG_INT}}}'),
    "ad_deep": ("ad_deep.json", "[" * 100_000 + "]" * 100_000),
    "ad_re_bt": ("ad_re_bt.json", '{"r": 8, "target_modules": "(.|.)*Z"}'),
    "ad_re_bt2": ("ad_re_bt2.json", '{"r": 8, "target_modules": "([a-z_.0-9]+)+Z"}'),
    "ad_re_bt3": ("ad_re_bt3.json", '{"r": 8, "target_modules": "(\\\\w+\\\\.?)+!"}'),
    "ad_re_rank_bt": ("ad_re_rank_bt.json", '{"r": 8, "target_modules": ["q_proj"], "rank_pattern": '
                                            '{"(.|.)*Z": 4}}'),
    "ad_re_save_bt": ("ad_re_save_bt.json", '{"r": 8, "target_modules": ["q_proj"], "modules_to_save": '
                                            '["(.|.)*Z"]}'),
    "ad_re_bad": ("ad_re_bad.json", '{"r": 8, "target_modules": "(["}'),
    "ad_re_bad2": ("ad_re_bad2.json", '{"r": 8, "target_modules": "*q_proj"}'),
    "ad_re_rank_bad": ("ad_re_rank_bad.json", '{"r": 8, "target_modules": ["q_proj"], "rank_pattern": {"(": 4}}'),
    "ad_re_save_bad": ("ad_re_save_bad.json", '{"r": 8, "target_modules": ["q_proj"], "modules_to_save": ["(x"]}'),
    "ad_r_huge": ("ad_r_huge.json", '{"r": 1e300, "target_modules": ["q_proj"]}'),
    "ad_r_big": ("ad_r_big.json", '{"r": 100000000000, "target_modules": ["q_proj"]}'),
    "ad_r_zero": ("ad_r_zero.json", '{"r": 0, "target_modules": ["q_proj"]}'),
    "ad_r_neg": ("ad_r_neg.json", '{"r": -4, "target_modules": ["q_proj"]}'),
    "ad_r_frac": ("ad_r_frac.json", '{"r": 2.5, "target_modules": ["q_proj"]}'),
    "ad_r_str": ("ad_r_str.json", '{"r": "eight", "target_modules": ["q_proj"]}'),
    "ad_r_bool": ("ad_r_bool.json", '{"r": true, "target_modules": ["q_proj"]}'),
    "ad_r_nan": ("ad_r_nan.json", '{"r": NaN, "target_modules": ["q_proj"]}'),
    "ad_rank_pattern_huge": ("ad_rp_huge.json", '{"r": 8, "target_modules": ["q_proj"], "rank_pattern": '
                                                '{"q_proj": 100000000000}}'),
    "ad_alpha_nan": ("ad_alpha_nan.json", '{"r": 8, "lora_alpha": NaN, "target_modules": ["q_proj"]}'),
    "ad_alpha_inf": ("ad_alpha_inf.json", '{"r": 8, "lora_alpha": Infinity, "target_modules": ["q_proj"]}'),
    "ad_dropout": ("ad_dropout.json", '{"r": 8, "lora_dropout": 1.0, "target_modules": ["q_proj"]}'),
    "ad_dropout_neg": ("ad_dropout_neg.json", '{"r": 8, "lora_dropout": -0.1, "target_modules": ["q_proj"]}'),
    "ad_bias": ("ad_bias.json", '{"r": 8, "bias": "some", "target_modules": ["q_proj"]}'),
    "ad_targets_int": ("ad_targets_int.json", '{"r": 8, "target_modules": [1, 2]}'),
    "ad_targets_dict": ("ad_targets_dict.json", '{"r": 8, "target_modules": {"q_proj": 1}}'),
    "ad_targets_none": ("ad_targets_none.json", '{"r": 8, "target_modules": ["nope_proj"]}'),
    "ad_layers_str": ("ad_layers_str.json", '{"r": 8, "target_modules": ["q_proj"], "layers_to_transform": "0"}'),
    "ad_save_int": ("ad_save_int.json", '{"r": 8, "target_modules": ["q_proj"], "modules_to_save": [3]}'),
    "ad_rank_pattern_list": ("ad_rp_list.json", '{"r": 8, "target_modules": ["q_proj"], "rank_pattern": [1]}'),
    "ad_peft_type": ("ad_peft_type.json", '{"peft_type": "PREFIX_TUNING"}'),
    "ad_dora": ("ad_dora.json", '{"r": 8, "use_dora": true, "target_modules": ["q_proj"]}'),
    "ad_intkey": ("ad_intkey.json", '{"r": 8}'),  # JSON keys are always text: a control that runs
    # ds_config
    "ds_bigint": ("ds_bigint.json", f'{{"zero_optimization": {{"stage": 2}}, "unused": {BIG_INT}}}'),
    "ds_deep": ("ds_deep.json", "[" * 100_000 + "]" * 100_000),
    "ds_big": ("ds_big.json", ("sparse", 17 << 20)),
    "ds_urandom": ("ds_urandom.json", ("link", "/dev/urandom")),
    "ds_zero_list": ("ds_zero_list.json", '{"zero_optimization": [1]}'),
    "ds_stage_float": ("ds_stage_float.json", '{"zero_optimization": {"stage": 2.5}}'),
    # model sources: config.json
    "m_bigint": ("m_bigint/config.json", json.dumps(LLAMA)[:-1] + f', "junk": {BIG_INT}}}'),
    "m_no_hidden": ("m_no_hidden/config.json", json.dumps({k: v for k, v in LLAMA.items() if k != "hidden_size"})),
    "m_no_heads": ("m_no_heads/config.json", json.dumps({k: v for k, v in LLAMA.items()
                                                          if k != "num_attention_heads"})),
    "m_no_layers": ("m_no_layers/config.json", json.dumps({k: v for k, v in LLAMA.items()
                                                            if k != "num_hidden_layers"})),
    "m_only_type": ("m_only_type/config.json", '{"model_type": "llama"}'),
    "m_rope_str": ("m_rope_str/config.json", json.dumps({**LLAMA, "rope_scaling": "banana"})),
    "m_rope_list": ("m_rope_list/config.json", json.dumps({**LLAMA, "rope_scaling": [1, 2]})),
    "m_rope_type": ("m_rope_type/config.json", json.dumps({**LLAMA, "rope_scaling": {"rope_type": "warp"}})),
    "m_rope_factor": ("m_rope_factor/config.json", json.dumps({**LLAMA, "rope_scaling": {"rope_type": "linear",
                                                                                           "factor": "x"}})),
    "m_rope_nofactor": ("m_rope_nofactor/config.json", json.dumps({**LLAMA, "rope_scaling": {"rope_type": "yarn"}})),
    "m_rope_negfactor": ("m_rope_neg/config.json", json.dumps({**LLAMA, "rope_scaling": {"type": "dynamic",
                                                                                         "factor": -2}})),
    "m_rope_params": ("m_rope_params/config.json", json.dumps({**LLAMA, "rope_parameters": 7})),
    "m_deep": ("m_deep/config.json", "[" * 100_000 + "]" * 100_000),
    "m_deep_65": ("m_deep_65/config.json", json.dumps({**LLAMA})[:-1] + ', "x": ' + "[" * 70 + "]" * 70 + "}"),
    "m_big": ("m_big/config.json", ("sparse", 17 << 20)),
    "m_link_zero": ("m_link_zero/config.json", ("link", "/dev/zero")),
    "m_link_fifo": ("m_link_fifo/config.json", ("link", "../fifo.json")),
    "m_dir_config": ("m_dir_config/config.json", ("dir",)),
    "m_idx_bigint": ("m_idx_bigint/model.safetensors.index.json", f'{{"weight_map": {{"a": "x"}}, "n": {BIG_INT}}}'),
    "m_idx_bigint_cfg": ("m_idx_bigint/config.json", json.dumps(LLAMA)),
    "m_idx_fifo": ("m_idx_fifo/model.safetensors.index.json", ("fifo",)),
    "m_idx_fifo_cfg": ("m_idx_fifo/config.json", json.dumps(LLAMA)),
    "m_st_bigint_cfg": ("m_st_bigint/config.json", json.dumps(LLAMA)),
    "m_st_bigint": ("m_st_bigint/model.safetensors", None),  # made below: a header with a 5,000-digit integer
    "m_st_fifo_cfg": ("m_st_fifo/config.json", json.dumps(LLAMA)),
    "m_st_fifo": ("m_st_fifo/model.safetensors", ("fifo",)),
    "fifo": ("fifo.json", ("fifo",)),
    "outside_cfg": ("outside/config.json", json.dumps(LLAMA)),
    # the Hugging Face cache: HF_HOME={dir}/hf
    "hf_up_ref": ("hf/hub/models--evil--up/refs/main", "../../../../outside\n"),
    "hf_up_snap": ("hf/hub/models--evil--up/snapshots", ("dir",)),
    "hf_abs_ref": ("hf/hub/models--evil--abs/refs/main", "/etc\n"),
    "hf_abs_snap": ("hf/hub/models--evil--abs/snapshots", ("dir",)),
    "hf_dot_ref": ("hf/hub/models--evil--dot/refs/main", "..\n"),
    "hf_dot_snap": ("hf/hub/models--evil--dot/snapshots/x/config.json", json.dumps(LLAMA)),
    "hf_link_cfg": ("hf/hub/models--evil--link/snapshots/abc/config.json", ("link", "../../../../../outside/config.json")),
    "hf_link_st_cfg": ("hf/hub/models--evil--linkst/snapshots/abc/config.json", json.dumps(LLAMA)),
    "hf_link_st": ("hf/hub/models--evil--linkst/snapshots/abc/model.safetensors", ("link", "/etc/hostname")),
    "hf_fifo_ref": ("hf/hub/models--evil--fiforef/refs/main", ("fifo",)),
    "hf_fifo_ref_snap": ("hf/hub/models--evil--fiforef/snapshots/abc/config.json", json.dumps(LLAMA)),
    "hf_big_ref": ("hf/hub/models--evil--bigref/refs/main", ("sparse", 1 << 20)),
    "hf_big_ref_snap": ("hf/hub/models--evil--bigref/snapshots/abc/config.json", json.dumps(LLAMA)),
    "hf_ok_blob": ("hf/hub/models--good--m/blobs/123", json.dumps(LLAMA)),
    "hf_ok_cfg": ("hf/hub/models--good--m/snapshots/abc/config.json", ("link", "../../blobs/123")),
    "hf_ok_ref": ("hf/hub/models--good--m/refs/main", "abc\n"),
    # plots
    "plot_fifo": ("plot_fifo.svg", ("fifo",)),
    "plot_dir": ("plot_dir.svg", ("dir",)),
    "plot_link_null": ("plot_null.png", ("link", "/dev/null")),
    # factories: PYTHONPATH={dir}/factories
    "factories": ("factories/hostile_factories.py", (
        "import os, signal, subprocess, sys\n"
        "def _model():\n"
        "    import torch\n"
        "    return torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10))\n"
        "def exit0():\n    os._exit(0)\n"
        "def exit3():\n    os._exit(3)\n"
        "def sysexit():\n    sys.exit(0)\n"
        "def abort():\n    os.abort()\n"
        "def killself():\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "def loop():\n    while True:\n        pass\n"
        "def deaf():\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n        pass\n"
        "def forks():\n    os.fork()\n    raise ValueError('forked')\n"
        "def spawns():\n    subprocess.Popen(['sleep', '300.0421'])\n    raise ValueError('spawned')\n"
        "def empty():\n    import torch\n    return torch.nn.Sequential()\n"
        "def number():\n    return 42\n"
        "def raises():\n    raise RuntimeError('boom ' * 1000)\n"
        "def prints():\n    print('garbage on stdout')\n    raise ValueError('printed')\n"
        "def keyboard():\n    raise KeyboardInterrupt\n"
        "not_callable = 5\n")),
    "factory_import_exit": ("factories/exits_at_import.py", "import os\nos._exit(0)\n"),
    "factory_import_loop": ("factories/loops_at_import.py", "while True:\n    pass\n"),
    "factory_syntax": ("factories/broken_syntax.py", "def (:\n"),
    # encoder-decoders (model/tasks.py SEQ2SEQ): flan-t5-base and bart-large as shipped, and one nesting its parts
    "t5": ("t5.json", (Path(__file__).resolve().parents[1] / "data" / "configs" / "flan-t5-base.json").read_text()),
    "bart": ("bart.json", (Path(__file__).resolve().parents[1] / "data" / "configs" / "bart-large.json").read_text()),
    "mllama": ("mllama.json", (Path(__file__).resolve().parents[1] / "data" / "configs" / "mllama-tiny.json").read_text()),
    "qwen35": ("qwen35.json", (Path(__file__).resolve().parents[1] / "data" / "configs" / "qwen3.5-tiny.json").read_text()),
    "llama4vl": ("llama4vl.json", json.dumps({"architectures": ["Llama4ForConditionalGeneration"],
                                              "model_type": "llama4", "text_config": {"model_type": "llama4_text"},
                                              "vision_config": {"model_type": "llama4_vision_model"}})),
    "nested_s2s": ("nested_s2s.json", json.dumps({"architectures": ["T5GemmaForConditionalGeneration"],
                                                  "model_type": "t5gemma", "is_encoder_decoder": True,
                                                  "encoder": {"hidden_size": 64}, "decoder": {"hidden_size": 64}})),
}

_ENV_HF = {"HF_HOME": "{dir}/hf", "HF_HUB_CACHE": None, "HUGGINGFACE_HUB_CACHE": None}  # None: unset
_ENV_FAC = {"PYTHONPATH": "{dir}/factories", "MEMPLAN_FACTORY_TIMEOUT": "2"}


def _allocator_cases() -> list[Case]:
    """What PyTorch 2.13's parser refuses, or honours and the replay does not model, from the command line and
    from both environment variables; and a memory fraction that moves the verdict."""
    refused = [("max_split_size_mb:1_000", "too small"), ("max_split_size_mb:\u0661\u0660\u0660", "not a number"),
               ("max_split_size_mb:x", "not a number"), ("max_split_size_mb:19", "too small"),
               ("max_split_size_mb", "the text ends"), ("max_split_size_mb:", "the text ends"),
               ("max_split_size_mb:99999999999999999999999", "out of range"),
               ("release_lock_on_cudamalloc:banana", "expected True or False"),
               ("release_lock_on_cudamalloc:true", "expected True or False"),
               ("expandable_segments:1", "expected True or False"), ("expandable_segments", "the text ends"),
               ("garbage_collection_threshold:1.5", "(0.0, 1.0)"), ("garbage_collection_threshold:nan", "(0.0, 1.0)"),
               ("garbage_collection_threshold:0", "(0.0, 1.0)"), ("garbage_collection_threshold:1e-400", "out of range"),
               ("garbage_collection_threshold:abc", "not a number"), ("per_process_memory_fraction:1.5", "[0.0, 1.0]"),
               ("per_process_memory_fraction:-0.1", "[0.0, 1.0]"), ("per_process_memory_fraction:nan", "[0.0, 1.0]"),
               ("per_process_memory_fraction:inf", "[0.0, 1.0]"), ("per_process_memory_fraction:half", "not a number"),
               ("roundup_power2_divisions:3", "power of 2"), ("roundup_power2_divisions:0", "power of 2"),
               ("roundup_power2_divisions:[256:3]", "power of 2 or 0"), ("roundup_power2_divisions:[3:4]", "intervals"),
               ("roundup_power2_divisions:[256:4,>:2", "the text ends"), ("pinned_num_register_threads:3", "power of 2"),
               ("pinned_num_register_threads:256", "at most 128"), ("pinned_reserve_segment_size_mb:0", "greater than 0"),
               ("backend:magic", "native and cudaMallocAsync"), ("backend:cudaMallocAsync", "not modelled"),
               ("large_segment_size_mb:64", "not modelled"), ("large_segment_size_mb:5", "must be > 10"),
               ("throw_on_cudamalloc_oom:True", "not modelled"), ("foo:1", "unrecognized key 'foo'"),
               ("expandable:True", "unrecognized key"), (",", "unrecognized key ','"),
               (":", "unrecognized key ':'"),
               ("max_split_size_mb:100,bogus", "unrecognized key"), ("[", "unrecognized key")]
    out = []
    for text, needle in refused:
        out.append(Case(f"estimate gpt2 --allocator-conf {text}", needle, "allocator-conf"))
        out.append(Case("estimate gpt2", needle, "allocator-conf env", env={"PYTORCH_CUDA_ALLOC_CONF": text}))
        out.append(Case("check gpt2 --gpu h100-80g", needle, "allocator-conf env", env={"PYTORCH_ALLOC_CONF": text}))
    # honoured: the fraction caps the allocator (the verdict moves), from the command line, the environment, check
    frac = "per_process_memory_fraction:0.05"
    out += [Case(f"estimate llama-7b --gpus 8 --stage 3 --gpu h100-80g --no-suggestions --allocator-conf {frac}",
                 "", "allocator-conf", expect=1),
            Case("estimate llama-7b --gpus 8 --stage 3 --gpu h100-80g --no-suggestions", "", "allocator-conf env",
                 env={"PYTORCH_CUDA_ALLOC_CONF": frac}, expect=1),
            Case("check llama-7b --gpus 8 --stage 3 --gpu h100-80g", "", "allocator-conf env",
                 env={"PYTORCH_ALLOC_CONF": frac}, expect=1),
            Case("plan llama-7b --gpu h100-80g --max-gpus 8 --allocator-conf per_process_memory_fraction:0.01", "",
                 "allocator-conf", expect=1),
            Case("estimate gpt2 --gpu h100-80g --allocator-conf max_split_size_mb:-3", "", "allocator-conf", expect=0),
            Case("estimate gpt2 --gpu h100-80g --allocator-conf max_split_size_mb:100abc,expandable_segments:True", "",
                 "allocator-conf", expect=0)]
    return out


def _factory_cases() -> list[Case]:
    slow = {"loop", "deaf", "loops_at_import"}
    cases = [("hostile_factories:exit0", "ended its process (exit code 0)"),
             ("hostile_factories:exit3", "ended its process (exit code 3)"),
             ("hostile_factories:sysexit", "SystemExit"),
             ("hostile_factories:abort", "killed by SIGABRT"),
             ("hostile_factories:killself", "killed by SIGKILL"),
             ("hostile_factories:loop", "did not finish building the model within 2 s"),
             ("hostile_factories:deaf", "did not finish building the model within 12 s"),
             ("hostile_factories:forks", "forked"),
             ("hostile_factories:spawns", "spawned"),
             ("hostile_factories:empty", "no parameters"),
             ("hostile_factories:number", "returned int, not a torch.nn.Module"),
             ("hostile_factories:raises", "RuntimeError: boom"),
             ("hostile_factories:prints", "printed"),
             ("hostile_factories:keyboard", "KeyboardInterrupt"),
             ("hostile_factories:not_callable", "is not callable"),
             ("hostile_factories:missing", "has no attribute"),
             ("exits_at_import:make", "ended its process (exit code 0)"),
             ("loops_at_import:make", "did not finish importing it within 2 s"),
             ("broken_syntax:make", "SyntaxError"),
             ("no_such_module:make", "ModuleNotFoundError"),
             ("hostile_factories:", "must look like pkg.module:callable")]
    out = []
    for spec, needle in cases:
        name = spec.split(":")[1] or spec
        for cmd in (("check", "--gpu h100-80g"),) + ((("estimate", "--json"),) if name in ("exit0", "forks") else ()):
            out.append(Case(f"{cmd[0]} {spec} {cmd[1]}", needle, "factory", env=_ENV_FAC,
                            slow=name in slow or spec.split(":")[0] in slow))
    return out


CASES: list[Case] = [
    # TrainingArguments
    *(Case(f"estimate llama-3-8b --training-args {{dir}}/{f}", n, "training-args") for f, n in [
        ("ta_bomb.yaml", "expands to more than 100,000 values"), ("ta_bomb_wide.yaml", "expands to more than"),
        ("ta_bomb_nested.yaml", "expands to more than"), ("ta_bomb_kwargs.yaml", "expands to more than"),
        ("ta_recursive.yaml", "refers to itself"), ("ta_python_tag.yaml", "not valid YAML"),
        ("ta_python_name.yaml", "not valid YAML"), ("ta_bigint.yaml", "more than 4,300 digits"),
        ("ta_bigint_ignored.json", "5,000 digits"), ("ta_bigint_neg.json", "5,000 digits"),
        ("ta_intkey.yaml", "the key 1 is not text"), ("ta_boolkey.yaml", "the key True is not text"),
        ("ta_nullkey.yaml", "the key None is not text"), ("ta_deep.yaml", "nested too deeply"),
        ("ta_deep.json", "nested too deeply"), ("ta_deep_65.json", "nested too deeply"),
        ("ta_kwargs_deep.json", "nested too deeply"), ("ta_kwargs_str.json", "activation_checkpointing_kwargs"),
        ("ta_kwargs_list.json", "must be a mapping"), ("ta_every_str.json", "every_n_layers must be an integer"),
        ("ta_not_utf8.json", "not UTF-8"), ("ta_list.json", "must hold a mapping"),
        ("ta_scalar.yaml", "must hold a mapping"), ("ta_empty.yaml", "must hold a mapping"),
        ("ta_bad.yaml", "not valid YAML at line"), ("ta_tab.yaml", "not valid YAML"),
        ("ta_dup.json", "bf16 and fp16 are both set"), ("ta_mb_zero.json", "per_device_train_batch_size"),
        ("ta_mb_float.json", "per_device_train_batch_size"), ("ta_mb_str.json", "per_device_train_batch_size"),
        ("ta_mb_nan.json", "per_device_train_batch_size"), ("ta_mb_inf.json", "per_device_train_batch_size"),
        ("ta_ga_neg.json", "gradient_accumulation_steps"), ("ta_bf16_str.json", "bf16 must be true or false"),
        ("ta_optim_int.json", "optim must be an optimizer name"), ("ta_optim_unknown.json", "adamw_quantum"),
        ("ta_optim_long.json", "is not an optimizer"), ("ta_fsdp_ints.json", "fsdp must be option names"),
        ("ta_fsdp_bogus.json", "'turbo'"), ("ta_fsdp_cfg_list.json", "fsdp_config must be a mapping"),
        ("ta_fsdp_cfg_missing.json", "cannot read fsdp_config"), ("ta_fsdp_version.json", "fsdp_version must be 1 or 2"),
        ("ta_fsdp_version_str.json", "fsdp_version must be 1 or 2"),
        ("ta_fsdp_and_ds.json", "fsdp and deepspeed are both set"),
        ("ta_ds_dict.json", "deepspeed must be the path"), ("ta_ds_list_file.json", "must hold a JSON object"),
        ("ta_ds_fifo.json", "is not a regular file"), ("ta_ds_devzero.json", "is not a regular file"),
        ("ta_ds_mismatch.json", "the Trainer refuses"), ("ta_wrap_cls_int.json", "must be class names"),
        ("ta_wrap_policy.json", "auto-wrap policy 'MAGIC'"), ("ta_big.json", "more than the 16,777,216-byte limit"),
        ("fifo.json", "is not a regular file"), ("missing.yaml", "No such file or directory"),
        ("ad_dir_empty", "is not a regular file")]),
    Case("estimate llama-3-8b --training-args /dev/zero", "is not a regular file", "training-args"),
    Case("estimate llama-3-8b --training-args /dev/urandom", "is not a regular file", "training-args"),
    Case("check llama-3-8b --gpu h100-80g --training-args {dir}/ta_bomb.yaml", "expands to more than", "check"),
    # Accelerate configs
    *(Case(f"estimate llama-3-8b --accelerate-config {{dir}}/{f}", n, "accelerate-config") for f, n in [
        ("acc_bomb.yaml", "expands to more than"), ("acc_bomb_fsdp.yaml", "expands to more than"),
        ("acc_recursive.yaml", "refers to itself"), ("acc_tag.yaml", "not valid YAML"),
        ("acc_fsdp_list.yaml", "fsdp_config must be a mapping"), ("acc_fsdp_str.yaml", "fsdp_config must be a mapping"),
        ("acc_fsdp_int.yaml", "fsdp_config must be a mapping"), ("acc_fv_abc.yaml", "fsdp_version must be 1 or 2"),
        ("acc_fv_null.yaml", "fsdp_version must be 1 or 2"), ("acc_fv_list.yaml", "fsdp_version must be 1 or 2"),
        ("acc_fv_sup.yaml", "fsdp_version must be 1 or 2"), ("acc_fv_float.yaml", "fsdp_version must be 1 or 2"),
        ("acc_fv_3.yaml", "fsdp_version must be 1 or 2"), ("acc_fv_true.yaml", "fsdp_version must be 1 or 2"),
        ("acc_intkey.yaml", "the key 1 is not text"), ("acc_intkey_nested.yaml", "the key 7 is not text"),
        ("acc_ds_list.yaml", "deepspeed_config must be a mapping"), ("acc_ds_str.yaml", "deepspeed_config must be a"),
        ("acc_ds_stage.yaml", "zero_stage must be 0, 1, 2 or 3"), ("acc_ds_file_fifo.yaml", "is not a regular file"),
        ("acc_ds_off_dev.yaml", "must be none, cpu or nvme"), ("acc_pc_list.yaml", "parallelism_config must be a"),
        ("acc_pc_tp.yaml", "tp_size must be an integer of at least 1"),
        ("acc_procs.yaml", "num_processes must be an integer"), ("acc_procs_str.yaml", "num_processes must be an"),
        ("acc_machines.yaml", "not a multiple of num_machines"), ("acc_mixed.yaml", "mixed_precision must be"),
        ("acc_dist.yaml", "distributed_type 'TPU' is not modelled"), ("acc_sharding.yaml", "is not 1-5"),
        ("acc_bigint.yaml", "more than 4,300 digits"), ("fifo.json", "is not a regular file")]),
    Case("estimate llama-3-8b --accelerate-config /dev/zero", "is not a regular file", "accelerate-config"),
    # a command-line strategy that leaves the file's framework: the file's FSDP settings no longer apply
    Case("estimate llama-3-8b --accelerate-config {dir}/acc_ok_fsdp.yaml --stage 3 --no-suggestions", "",
         "accelerate-config", expect=0),
    # PEFT adapter configs
    *(Case(f"estimate llama-3-8b --adapter-config {{dir}}/{f}", n, "adapter-config") for f, n in [
        ("ad_zero", "is not a regular file"), ("ad_urandom", "is not a regular file"),
        ("ad_fifo.json", "is not a regular file"), ("ad_dir_fifo", "is not a regular file"),
        ("ad_dir_empty", "No such file or directory"), ("ad_big.json", "16,777,216-byte limit"),
        ("ad_not_utf8.json", "not UTF-8"), ("ad_bigint.json", "5,000 digits"),
        ("ad_bigint_ignored.json", "5,000 digits"), ("ad_deep.json", "nested too deeply"),
        ("ad_re_bt.json", "did not finish within 1 s"), ("ad_re_bt2.json", "did not finish within 1 s"),
        ("ad_re_bt3.json", "did not finish within 1 s"), ("ad_re_rank_bt.json", "did not finish within 1 s"),
        ("ad_re_save_bt.json", "did not finish within 1 s"), ("ad_re_bad.json", "is not a regular expression"),
        ("ad_re_bad2.json", "is not a regular expression"), ("ad_re_rank_bad.json", "is not a regular expression"),
        ("ad_re_save_bad.json", "is not a regular expression"), ("ad_r_huge.json", "more than any LoRA rank"),
        ("ad_r_big.json", "more than any LoRA rank"), ("ad_r_zero.json", "at least 1"), ("ad_r_neg.json", "at least 1"),
        ("ad_r_frac.json", "r must be a number"), ("ad_r_str.json", "r must be a number"),
        ("ad_r_bool.json", "r must be a number"), ("ad_r_nan.json", "r must be a number"),
        ("ad_rp_huge.json", "more than any LoRA rank"), ("ad_alpha_nan.json", "--lora-alpha must be a positive"),
        ("ad_alpha_inf.json", "--lora-alpha must be a positive"), ("ad_dropout.json", "dropout must be in [0, 1)"),
        ("ad_dropout_neg.json", "dropout must be in [0, 1)"), ("ad_bias.json", "bias must be none, all or lora_only"),
        ("ad_targets_int.json", "target_modules must be"), ("ad_targets_dict.json", "target_modules must be"),
        ("ad_targets_none.json", "match no linear layer"), ("ad_layers_str.json", "layers_to_transform must be"),
        ("ad_save_int.json", "modules_to_save must be a list"), ("ad_rp_list.json", "rank_pattern must map"),
        ("ad_peft_type.json", "peft_type PREFIX_TUNING is not modelled"), ("ad_dora.json", "DoRA")]),
    Case("estimate llama-3-8b --adapter-config /dev/zero", "is not a regular file", "adapter-config"),
    Case("estimate llama-3-8b --adapter-config /dev/urandom", "is not a regular file", "adapter-config"),
    Case("plan llama-3-8b --gpu h100-80g --max-gpus 8 --adapter-config {dir}/ad_re_bt.json", "did not finish",
         "adapter-config"),
    # ds_config
    *(Case(f"estimate gpt2 --deepspeed {{dir}}/{f}", n, "deepspeed") for f, n in [
        ("ds_bigint.json", "5,000 digits"), ("ds_deep.json", "nested too deeply"),
        ("ds_big.json", "16,777,216-byte limit"), ("ds_urandom.json", "is not a regular file"),
        ("ds_zero_list.json", "zero_optimization must be an object"), ("ds_stage_float.json", "stage must be 0, 1")]),
    Case("estimate gpt2 --deepspeed /dev/urandom", "is not a regular file", "deepspeed"),
    # config.json and model directories
    *(Case(f"estimate {{dir}}/{d}", n, "config.json") for d, n in [
        ("m_bigint", "5,000 digits"), ("m_no_hidden", "gives no hidden size"), ("m_no_heads", "attention head count"),
        ("m_no_layers", "layer count"), ("m_only_type", "gives no hidden size"), ("m_rope_str", "must be a mapping"),
        ("m_rope_list", "must be a mapping"), ("m_rope_type", "rope type 'warp'"), ("m_rope_factor", "factor must be"),
        ("m_rope_nofactor", "needs a factor"), ("m_rope_neg", "factor must be"), ("m_rope_params", "must be a mapping"),
        ("m_deep", "nested too deeply"), ("m_deep_65", "nested too deeply"), ("m_big", "16,777,216-byte limit"),
        ("m_link_zero", "is not a regular file"), ("m_link_fifo", "is not a regular file"),
        ("m_dir_config", "is not a regular file"), ("m_idx_bigint", "5,000 digits"),
        ("m_idx_fifo", "is not a regular file"), ("m_st_bigint", "5,000 digits"), ("m_st_fifo", "is not a regular")]),
    Case("inspect {dir}/m_bigint", "5,000 digits", "config.json"),
    Case("inspect {dir}/m_no_hidden", "gives no hidden size", "config.json"),
    Case("estimate /dev/urandom", "is not a regular file or a directory", "config.json"),
    # the Hugging Face cache
    *(Case(f"estimate {repo}", n, "hf-cache", env=_ENV_HF) for repo, n in [
        ("evil/up", "not a snapshot of evil/up"), ("evil/abs", "not a snapshot of evil/abs"),
        ("evil/dot", "not a snapshot of evil/dot"), ("evil/link", "lies outside the Hugging Face cache"),
        ("evil/linkst", "lies outside the Hugging Face cache"), ("evil/fiforef", "is not a regular file"),
        ("evil/bigref", "more than the 4,096-byte limit"), ("a--b/c", "is not a Hugging Face repo id"),
        ("a/b--c", "is not a Hugging Face repo id"), ("a/..b", "is not a Hugging Face repo id"),
        ("a./b", "is not a Hugging Face repo id"), ("a/b.", "is not a Hugging Face repo id"), ("a/" + "b" * 200, "is not a Hugging Face repo id"),
        ("nobody/nothing", "not a preset, a path, or a repo in the local Hugging Face cache")]),
    Case("estimate good/m --no-suggestions", "", "hf-cache", env=_ENV_HF, expect=0),
    # --plot
    *(Case(f"estimate gpt2 --plot {p}", n, "plot") for p, n in [
        ("{dir}/plot_fifo.svg", "is not a regular file"), ("{dir}/plot_dir.svg", "is not a regular file"),
        ("{dir}/plot_null.png", "is not a regular file"), ("/dev/null", "must end in .svg or .png"),
        ("-", "stdout carries the table"), ("{dir}/nowhere/x.svg", "no directory"),
        ("{dir}/x.pdf", "must end in .svg or .png"), ("{dir}/x", "must end in .svg or .png")]),
    Case("plan gpt2 --gpu h100-80g --plot {dir}/plot_fifo.svg", "is not a regular file", "plot"),
    Case("plan gpt2 --gpu h100-80g --plot -", "stdout carries the table", "plot"),
    # shell completion
    *(Case("", n, "completion", env=e, subprocess=True) for e, n in [
        ({"_MEMPLAN_COMPLETE": "complete_bash", "COMP_WORDS": "memplan est", "COMP_CWORD": "abc"}, "COMP_CWORD='abc'"),
        ({"_MEMPLAN_COMPLETE": "complete_bash", "COMP_WORDS": "memplan est", "COMP_CWORD": "-1"}, "COMP_CWORD='-1'"),
        ({"_MEMPLAN_COMPLETE": "complete_bash", "COMP_WORDS": "memplan est", "COMP_CWORD": ""}, "COMP_CWORD=''"),
        ({"_MEMPLAN_COMPLETE": "complete_bash", "COMP_WORDS": "memplan est", "COMP_CWORD": "\u0661"}, "COMP_CWORD="),
        ({"_MEMPLAN_COMPLETE": "complete_bash", "COMP_WORDS": "memplan est"}, "one is missing"),
        ({"_MEMPLAN_COMPLETE": "complete_bash", "COMP_CWORD": "1"}, "one is missing"),
        ({"_MEMPLAN_COMPLETE": "bogus"}, "is not source_SHELL or complete_SHELL"),
        ({"_MEMPLAN_COMPLETE": "complete_tcsh"}, "is not source_SHELL or complete_SHELL"),
        ({"_MEMPLAN_COMPLETE": "source_"}, "is not source_SHELL or complete_SHELL"),
        ({"_MEMPLAN_COMPLETE": ""}, "is not source_SHELL or complete_SHELL")]),
    Case("", "", "completion", env={"_MEMPLAN_COMPLETE": "complete_bash", "COMP_WORDS": "memplan est",
                                    "COMP_CWORD": "1"}, subprocess=True, expect=0),
    # the output under encodings that lack memplan's characters
    *(Case(a, "", "encoding", env={"PYTHONIOENCODING": enc}, subprocess=True, expect=x) for a, enc, x in [
        ("estimate llama-7b --gpus 8 --stage 3 --gpu h100-80g", "ascii", 0),
        ("estimate llama-70b --gpus 8 --stage 3 --gpu h100-80g", "ascii", 1),
        ("estimate llama-7b --gpus 8 --stage 3 --gpu h100-80g --explain", "latin-1", 0),
        ("plan gpt2 --gpu h100-80g --max-gpus 8", "ascii", 0), ("presets", "ascii", 0),
        ("inspect gpt2", "ascii", 0), ("check llama-7b --gpu h100-80g --gpus 8 --stage 3", "ascii", 0),
        ("estimate nosuch\u00e9model", "ascii", 2)]),
    # --fsdp-wrap
    *(Case(f"estimate llama-7b --strategy fsdp-full --gpus 2 --fsdp-wrap {w}", n, "fsdp-wrap") for w, n in [
        ("size:1e400", "whole number of parameters"), ("size:\u0661e8", "whole number of parameters"),
        ("size:nan", "whole number of parameters"), ("size:inf", "whole number of parameters"),
        ("size:-5", "whole number of parameters"), ("size:0", "above zero"), ("size:", "must be one of"),
        ("size:2.5", "whole number of parameters"), ("size:1e20", "more parameters than any model has"),
        ("size:100X", "whole number of parameters"), ("size:1e99999", "whole number of parameters"),
        ("class:", "needs at least one module class"), ("class:NopeBlock", "no such module"), ("blocks", "must be one of"),
        ("class:" + ",".join(["A"] * 2000), "no such module")]),
    Case("estimate llama-7b --stage 3 --gpus 2 --fsdp-wrap none", "is for FSDP, not zero3", "fsdp-wrap"),
    # --z3-leaf-modules
    *(Case(f"estimate mixtral-8x7b --stage 3 --gpus 8 --z3-leaf-modules {z}", n, "z3-leaf") for z, n in [
        (",", "is empty"), ("NopeBlock", "no module of class NopeBlock"),
        (",".join(["X"] * 5000), "no module of class")]),
    Case("estimate mixtral-8x7b --strategy fsdp-full --gpus 8 --z3-leaf-modules MixtralSparseMoeBlock",
         "is DeepSpeed ZeRO-3's", "z3-leaf"),
    # --lora-*
    *(Case(f"estimate llama-3-8b {a}", n, "lora") for a, n in [
        ("--lora-rank 100000000000000000000000000000", "more than any LoRA rank"),
        ("--lora-rank 1048577", "more than any LoRA rank"), ("--lora-rank -1", "at least 1"),
        ("--lora-rank 1e300", "Invalid value for '--lora-rank'"), ("--lora-rank 8 --lora-alpha inf", "positive number"),
        ("--lora-rank 8 --lora-alpha -1", "positive number"), ("--lora-rank 8 --lora-dropout nan", "dropout must be"),
        ("--lora-rank 8 --lora-dropout -0.5", "dropout must be"),
        ("--lora-rank 8 --lora-targets " + ",".join(["x"] * 3000), "match no linear layer"),
        ("--lora-rank 8 --lora-targets .*", "match no linear layer"),
        ("--lora-rank 8 --quantize-base nf4 --quant-compute-dtype int8", "bfloat16, float16 or float32"),
        ("--lora-rank 8 --quantize-base q4", "--quantize-base must be nf4 or fp4"),
        ("--lora-alpha 16", "without --lora-rank"), ("--lora-dropout 0.1", "without --lora-rank")]),
    # the parallel options
    *(Case(f"estimate llama-3-8b --gpus 8 --strategy fsdp-full {a}", n, "parallel") for a, n in [
        ("--tp 0", "at least 1"), ("--tp 3", "tp"), ("--tp 1048577", "not a multiple"), ("--pp 0", "at least 1"),
        ("--pp 3", "pp"), ("--pp 64", "pp"), ("--cp 0", "at least 1"), ("--cp 3", "cp"), ("--ep 0", "at least 1"),
        ("--ep 3", "ep"), ("--pp 2 --vpp 0", "vpp"), ("--pp 2 --schedule warp", "unknown pipeline schedule"),
        ("--pp 4 --grad-accum 2", "Schedule1F1B needs at least as many micro-batches as stages"),
        ("--pp 2 --schedule dualpipev --grad-accum 3", "DualPipeV needs at least as many micro-batches as stages"),
        ("--pp 2 --schedule Interleaved1F1B --grad-accum 5", "multiple of its rounds"),
        ("--pp 2 --schedule zbv --vpp 3", "exactly two stages per rank"),
        ("--pp 2 --schedule gpipe --vpp 2", "needs a schedule that runs several stages per rank"),
        ("--sp", "--sp needs --tp"), ("--tp 2 --pp 2 --cp 2 --ep 2", "")]),
    Case("estimate llama-3-8b --gpus 8 --stage 2 --optimizer lion", "DeepSpeed refuses an untested optimizer",
         "parallel"),
    Case("estimate mixtral-8x7b --gpus 16 --ep 2 --pp 2 --grad-accum 2 --strategy fsdp-full "
         "--reshard-after-forward true", "--ep with --pp: modelled with the blocks and experts kept unsharded",
         "parallel"),
    Case("estimate gpt2 --optimizer apollo-adamw", "No target modules found", "parallel"),
    Case("estimate gpt2 --task summarisation", "--task 'summarisation': one of causal-lm", "parallel"),
    Case("estimate mixtral-8x7b --task masked-lm", "no masked-lm head for model_type 'mixtral'", "parallel"),
    Case("estimate {dir}/t5.json --activations analytic", "an encoder-decoder's (seq2seq) activations are traced",
         "parallel"),
    Case("estimate {dir}/t5.json --gpus 2 --strategy fsdp-full --tp 2", "--tp/--pp/--cp/--ep with an encoder-decoder",
         "parallel"),
    Case("estimate llama-7b --target-len 64", "only an encoder-decoder (seq2seq) model has a decoder input",
         "parallel"),
    Case("estimate {dir}/bart.json --seq-len 2048", "learns 1024 absolute positions", "parallel"),
    Case("estimate {dir}/bart.json --target-len 4096", "a longer target does not run", "parallel"),
    Case("estimate {dir}/t5.json --target-len 0", "--target-len must be at least 1", "parallel"),
    Case("estimate {dir}/nested_s2s.json", "nests encoder, decoder", "parallel"),
    Case("estimate {dir}/t5.json --task seq2seq-lm --gpus 2 --pp 2", "--tp/--pp/--cp/--ep with an encoder-decoder",
         "parallel"),
    # vision-language models (model/tasks.py IMAGE_TEXT) and --freeze (model/freeze.py)
    Case("estimate llava-1.5-7b --seq-len 576", "1 image(s) of 576 tokens each take 576 tokens", "parallel"),
    Case("estimate llava-1.5-7b --images -1", "--images must be 0 or more", "parallel"),
    Case("estimate qwen2.5-vl-7b --image-size 500", "multiples of 28 px", "parallel"),
    Case("estimate qwen2.5-vl-7b --image-size 448x", "give pixels, N (a square) or HxW", "parallel"),
    Case("estimate llama-3-8b --image-size 448", "only a vision-language model", "parallel"),
    Case("estimate {dir}/mllama.json --image-size 448", "takes images of its config's image_size (56 px)", "parallel"),
    Case("estimate {dir}/mllama.json --images 3 --seq-len 3", "leave no text", "parallel"),
    Case("estimate {dir}/llama4vl.json", "--task causal-lm trains its language model alone", "parallel"),
    Case("validate {dir}/qwen35.json --task summarisation --device cpu", "--task 'summarisation': one of", "parallel"),
    Case("estimate gemma-3-4b --images 100000", "leave no text", "parallel"),
    Case("estimate gpt2 --images 2", "only a vision-language model takes images", "parallel"),
    Case("estimate gemma-3-4b --gpus 4 --tp 2", "--tp/--pp/--cp/--ep with a vision-language", "parallel"),
    Case("estimate gpt2 --freeze vision", "this model has none", "parallel"),
    Case("estimate gpt2 --freeze transformer.nothing", "no parameter of gpt2 lies under it", "parallel"),
    Case("estimate gpt2 --freeze ,", "an empty path", "parallel"),
    Case("estimate gpt2 --freeze transformer,lm_head", "nothing trains", "parallel"),
    Case("estimate llama-3-8b --gpus 8 --strategy fsdp-full --optimizer apollo", "APOLLO projects each whole matrix",
         "parallel"),
    Case("estimate gpt2 --optimizer galore-adamw", "No target modules found", "parallel"),
    Case("estimate llama-3-8b --gpus 8 --stage 3 --precision bf16-autocast", "how plain PyTorch and DDP run it",
         "parallel"),
    Case("estimate llama-7b --gpus 3 --strategy ddp --optimizer muon-with-aux-adam", "fewer tensors than ranks",
         "parallel"),
    Case("estimate llama-7b --gpus 8 --stage 2 --optimizer muon-with-aux-adam",
         "MuonWithAuxAdam orthogonalises whole matrices", "parallel"),
    Case("estimate llama-3-8b --gpus 8 --stage 3 --optimizer galore", "GaLore projects each whole matrix",
         "parallel"),
    # check's own options
    *(Case(f"check llama-3-8b --gpus 8 --gpu h100-80g --max-fraction {f}", "--max-fraction", "check") for f in
      ("nan", "1.5", "0", "-0.1", "abc", "inf")),
    # numbers and capacities
    Case("estimate gpt2 --gpu-memory 100MiB", "not more than the CUDA context alone", "numbers"),
    Case("estimate gpt2 --gpu-memory 1B", "not more than the CUDA context alone", "numbers"),
    Case("estimate gpt2 --gpus 8 --gpus-per-node 16 --no-suggestions", "", "numbers", expect=0),
    Case("plan llama-7b --gpu h100-80g --layouts --max-gpus 1048576", "", "numbers", expect=0, slow=True),
    Case("estimate gpt2 --micro-batch " + "9" * 5000, "Invalid value for '--micro-batch'", "numbers"),
    Case("estimate gpt2 --seq-len -1", "seq-len must be at least 1", "numbers"),
    Case("validate gpt2 --help", "", "numbers", expect=0),
    *_allocator_cases(),
    *_factory_cases(),
]


def make_files(d: Path) -> None:
    """The files the cases name, under ``d``."""
    for name, (rel, content) in FILES.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            continue
        if isinstance(content, tuple):
            kind = content[0]
            if kind == "fifo":
                os.mkfifo(p)
            elif kind == "dir":
                p.mkdir(exist_ok=True)
            elif kind == "link":
                os.symlink(content[1], p)
            elif kind == "sparse":
                with open(p, "wb") as fh:
                    fh.truncate(content[1])
            continue
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    header = ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "n": ' + BIG_INT + "}").encode()
    (d / "m_st_bigint" / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)


def env_for(case: Case, d: Path) -> dict[str, str | None]:
    """The case's environment, ``{dir}`` filled in; None: the variable is unset."""
    return {k: None if v is None else v.format(dir=d) for k, v in case.env.items()}


def argv(case: Case, d: Path) -> list[str]:
    return [a.format(dir=d) for a in case.args.split()] if case.args else []
