"""Read a job's DeepSpeed config (ds_config.json) into memplan settings.

"auto" values are resolved as the Hugging Face Trainer resolves them (transformers/integrations/deepspeed.py,
HfTrainerDeepSpeedConfig.trainer_config_finalize): reduce_bucket_size = hidden_size^2,
stage3_prefetch_bucket_size = 0.9 * hidden_size^2, stage3_param_persistence_threshold = 10 * hidden_size;
batch sizes and gradient accumulation from the command line. Unknown keys are listed and ignored; invalid
values are errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError
from memplan.inputs import quote

#: top-level keys memplan reads
READ_TOP = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "bf16", "fp16",
            "zero_optimization", "data_types", "communication_data_type"}
#: top-level keys DeepSpeed 0.19.8 reads that memplan does not model: (changes memory, why). A key that changes
#: memory gets a note when the file sets it; the others are listed with their reason
IGNORED_TOP: dict[str, tuple[bool, str]] = {
    "train_batch_size": (False, "the global batch, micro-batch x accumulation x data-parallel GPUs: memplan takes "
                                "the micro-batch and the accumulation"),
    "scheduler": (False, "the learning-rate schedule allocates no device memory"),
    "gradient_clipping": (False, "clips the fp32 gradients in place (the norm they need is counted)"),
    "prescale_gradients": (False, "scales the gradients in place before their reduce"),
    "gradient_predivide_factor": (False, "scales the gradients in place"),
    "steps_per_print": (False, "logging"), "wall_clock_breakdown": (False, "timers"),
    "memory_breakdown": (False, "logging"), "dump_state": (False, "logging"), "comms_logger": (False, "logging"),
    "flops_profiler": (False, "profiling, outside the step"), "tensorboard": (False, "logging"),
    "wandb": (False, "logging"), "csv_monitor": (False, "logging"), "comet": (False, "logging"),
    "zero_allow_untested_optimizer": (False, "permits an optimizer; the optimizer is read from the job"),
    "zero_force_ds_cpu_optimizer": (False, "permits a non-DeepSpeed optimizer under ZeRO-Offload"),
    "checkpoint": (False, "checkpoint saving and loading, outside the step"),
    "dataloader_drop_last": (False, "the data loader's batches"),
    "seq_parallel_communication_data_type": (True, "Ulysses sequence parallelism, not modelled"),
    "torch_autocast": (True, "DeepSpeed's torch.autocast mode keeps fp32 parameters and autocasts the forward, "
                             "not modelled (the recipe follows bf16/fp16)"),
    "activation_checkpointing": (True, "DeepSpeed's own checkpointing API (deepspeed.checkpointing), which "
                                       "transformers' models do not call (they checkpoint with torch's; "
                                       "--recompute sets it)"),
    "compile": (True, "torch.compile of the engine's module: its kernels and buffers are not modelled"),
    "aio": (True, "NVMe offload's I/O buffers, not counted"),
    "pipeline": (True, "PipelineEngine knobs; the stages are PipelineModule's num_stages, in code: give --pp"),
    "hybrid_engine": (True, "the RLHF hybrid engine's inference containers, not modelled"),
    "tensor_parallel": (True, "AutoTP tensor parallelism, not modelled (--tp models Megatron's layers)"),
}
#: keys DeepSpeed 0.19.8 refuses outright (runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS and
#: _REMOVED_ZERO_CONFIG_KEYS, raised by _reject_removed_config_keys when the engine reads the config): what it says
REMOVED_TOP = {"nebula": "Nebula checkpointing has been removed", "compression_training": "the DeepSpeed "
               "compression library has been removed", "amp": "NVIDIA Apex AMP integration has been removed (use "
               "bf16, fp16 or torch_autocast)", "quantize_training": "Mixture-of-Quantization has been removed",
               "sparse_gradients": "sparse compression of embedding gradients has been removed",
               "eigenvalue": "eigenvalue-based MoQ has been removed", "sparse_attention": "Sparse Attention has been "
               "removed", "elasticity": "elastic training has been removed", "graph_harvesting": "graph harvesting "
               "has been removed", "curriculum_learning": "legacy top-level curriculum_learning has been removed",
               "progressive_layer_drop": "Progressive Layer Dropping has been removed"}
REMOVED_ZERO = {"mics_shard_size": "MiCS ZeRO-3 sharding has been removed",
                "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding has been removed",
                "zeropp_loco_param": "LoCo-Zero++ has been removed"}
#: deprecated zero_optimization keys DeepSpeed still reads (zero/config.py, config_utils
#: _process_deprecated_field): the key they set; giving both is DeepSpeed's error
DEPRECATED_ZERO = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
#: zero_optimization key -> memplan DeepSpeedKnobs field.
ZERO_KEYS = {"reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
             "overlap_comm": "overlap_comm", "contiguous_gradients": "contiguous_gradients",
             "stage3_prefetch_bucket_size": "prefetch_bucket_size", "prefetch_bucket_size": "prefetch_bucket_size",
             "stage3_param_persistence_threshold": "param_persistence_threshold",
             "param_persistence_threshold": "param_persistence_threshold",
             "stage3_max_live_parameters": "max_live_parameters", "max_live_parameters": "max_live_parameters",
             "stage3_max_reuse_distance": "max_reuse_distance", "max_reuse_distance": "max_reuse_distance",
             "sub_group_size": "sub_group_size", "zero_hpz_partition_size": "hpz_partition_size",
             "memory_efficient_linear": "memory_efficient_linear",
             "zero_quantized_weights": "quantized_weights", "zero_quantized_gradients": "quantized_gradients",
             "stage3_module_granularity_threshold": "module_granularity_threshold",
             "reduce_scatter": "reduce_scatter", "use_multi_rank_bucket_allreduce": "multi_rank_bucket_allreduce"}
#: zero_optimization keys read in load() itself
ZERO_READ_ELSEWHERE = {"stage", "offload_optimizer", "offload_param", "leaf_module"} | set(DEPRECATED_ZERO)
#: zero_optimization keys DeepSpeed 0.19.8 reads (zero/config.py DeepSpeedZeroConfig) that memplan does not model:
#: (changes memory, why), as IGNORED_TOP
ZERO_IGNORED: dict[str, tuple[bool, str]] = {
    "allgather_partitions": (False, "no ZeRO optimizer reads it in 0.19.8 (engine.py zero_allgather_partitions has "
                                    "no caller)"),
    "round_robin_gradients": (False, "reorders the partition's gradients, the same sizes"),
    "ignore_unused_parameters": (False, "a check on gradients that never arrive"),
    "load_from_fp32_weights": (False, "checkpoint loading"), "elastic_checkpoint": (False, "checkpoint loading"),
    "pipeline_loading_checkpoint": (False, "checkpoint loading"),
    "stage3_gather_16bit_weights_on_model_save": (False, "at a checkpoint save, outside the step"),
    "gather_16bit_weights_on_model_save": (False, "at a checkpoint save, outside the step"),
    "stage3_gather_fp16_weights_on_model_save": (False, "at a checkpoint save, outside the step"),
    "log_trace_cache_warnings": (False, "logging"), "enable_sanity_checks": (False, "debug checks"),
    "override_module_apply": (False, "how ZeRO-3 wraps Module.apply"),
    "legacy_stage1": (False, "removed: stage 1 runs the same optimizer as stage 2"),
    "cpu_offload_use_pin_memory": (False, "deprecated and not forwarded: DeepSpeed sets no pin_memory from it "
                                          "(zero/config.py: set_new_param False)"),
    "compute_grad_norm": (True, "false skips the gradient norm (its temporaries stay counted: an upper bound)"),
    "parameter_alignment": (True, "pads each parameter in the flat buffer to 16 bytes, not counted"),
    "stage3_model_persistence_threshold": (True, "caps the parameters ZeRO-3 keeps whole model-wide; memplan keeps "
                                                 "every one under stage3_param_persistence_threshold (an upper "
                                                 "bound)"),
    "model_persistence_threshold": (True, "as stage3_model_persistence_threshold"),
    "stage3_use_all_reduce_for_fetch_params": (True, "ZeRO-3 fetches parameters with an all-reduce of a whole "
                                                     "zeroed buffer instead of an all-gather, not modelled"),
    "use_all_reduce_for_fetch_params": (True, "as stage3_use_all_reduce_for_fetch_params"),
    "stage3_allgather_sequential": (True, "ZeRO-3 gathers one parameter at a time (fewer at once: an upper "
                                          "bound)"),
    "allgather_sequential": (True, "as stage3_allgather_sequential"),
    "zero_quantized_nontrainable_weights": (True, "ZeRO-3 keeps frozen weights int8-quantized, not modelled"),
    "zenflow": (True, "ZenFlow's offload and its buffers, not modelled"),
    "save_muon_momentum_buffer_in_memory": (True, "the Muon optimizer, not modelled"),
}
BOOL_KEYS = {"overlap_comm", "contiguous_gradients", "memory_efficient_linear", "zero_quantized_weights",
             "zero_quantized_gradients", "reduce_scatter", "use_multi_rank_bucket_allreduce"}


@dataclass(frozen=True)
class DsConfig:
    path: str
    stage: int | None
    knobs: dict[str, Any]  #: DeepSpeedKnobs field -> value (only what the file sets)
    recipe: str | None
    optimizer: str | None
    micro_batch: int | str | None  #: "auto" kept as the string until resolved
    grad_accum: int | str | None
    unknown_keys: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def partial(self, hidden_size: int | None) -> dict[str, Any]:
        """What the file sets, as a partial job request (memplan/request.py's field names, in the order options.py
        reads them): its "auto" sizes as the HF Trainer fills them from the model's hidden size, its "auto" batch
        sizes left to the job's other files (TrainingArguments fill them)."""
        out: dict[str, Any] = {}
        for name, value in (("stage", self.stage), ("precision", self.recipe), ("optimizer", self.optimizer),
                            ("micro_batch", self.micro_batch), ("grad_accum", self.grad_accum)):
            if value is not None and value != "auto":
                out[name] = value
        out.update(resolve_auto(self.knobs, hidden_size))
        return out


#: the largest count a ds_config value may hold (2^62): beyond it no buffer or batch is real
_MAX_INT = 1 << 62


def _int(value: Any, key: str, path: str) -> int:
    """A count, as DeepSpeed's config model reads one (an integer, or a float with an integer value, as 5e8)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            or int(value) != value or value > _MAX_INT):
        raise ConfigError(f"{path}: {key} must be a non-negative integer or \"auto\", got {quote(value)}")
    return int(value)


#: the strings pydantic (DeepSpeed's config models) reads as booleans in its lax mode
_BOOL_STRINGS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _bool(value: Any, key: str, path: str) -> bool:
    """A boolean as DeepSpeed's pydantic config models read it: true/false, 0/1, or their lax strings."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _BOOL_STRINGS:
        return _BOOL_STRINGS[value.strip().lower()]
    raise ConfigError(f"{path}: {key} must be true or false, got {quote(value)}")


def _precision_enabled(data: dict[str, Any], key: str, path: str) -> bool | None:
    """Whether the "bf16" / "fp16" section enables it (None: absent). DeepSpeed builds the section's config model
    from the object's keys (precision_config.py get_bfloat16_config: DeepSpeedBF16Config(**param_dict["bf16"])),
    so anything but an object fails there too."""
    if key not in data:
        return None
    section = data[key]
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: \"{key}\" must be an object such as {{\"enabled\": true}} (DeepSpeed builds "
                          f"its config from the object's keys), got {quote(section)}")
    for flag in ("bf16_master_weights_and_grads", "bf16_optimizer_states", "fp16_master_weights_and_grads"):
        if section.get(flag) is not None and _bool(section[flag], f"{key}.{flag}", path):
            raise ConfigError(f"{path}: {key}.{flag} (master weights, gradients or optimizer states kept in 16 bits, "
                              "runtime/base_optimizer.py _configure_master_weights) is not modelled; memplan models "
                              "DeepSpeed's fp32 master partition and states")
    enabled = section.get("enabled", False)
    if enabled == "auto":  # filled from the Trainer's / Accelerate's mixed precision (fill_match)
        return None
    return _bool(enabled, f"{key}.enabled", path)


def load(path: str) -> DsConfig:
    from memplan.inputs import load_json, read_text

    data = load_json(read_text(Path(path), "DeepSpeed config"), path, "DeepSpeed config")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    unknown = [k for k in data if k not in READ_TOP and k not in IGNORED_TOP]
    zero = data.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ConfigError(f"{path}: zero_optimization must be an object")
    for where, removed in ((data, REMOVED_TOP), (zero, REMOVED_ZERO)):
        for key, why in removed.items():
            if key in where:
                name = key if where is data else f"zero_optimization.{key}"
                raise ConfigError(f"{path}: DeepSpeed 0.19.8 refuses {name}: {why} (runtime/config.py "
                                  "_reject_removed_config_keys); remove it")
    zero = _deprecated(zero, path)
    stage = zero.get("stage")
    if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
        raise ConfigError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {quote(stage)}")
    knobs: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in zero.items():
        if key in ZERO_KEYS:
            if value == "auto":
                knobs[ZERO_KEYS[key]] = "auto"
            elif key in BOOL_KEYS:
                knobs[ZERO_KEYS[key]] = _bool(value, f"zero_optimization.{key}", path)
            else:
                knobs[ZERO_KEYS[key]] = _int(value, f"zero_optimization.{key}", path)
        elif key not in ZERO_IGNORED and key not in ZERO_READ_ELSEWHERE:
            unknown.append(f"zero_optimization.{key}")
    for key, field_name in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param")):
        sub = zero.get(key)
        if sub is None:
            continue
        if not isinstance(sub, dict):
            raise ConfigError(f"{path}: zero_optimization.{key} must be an object")
        device = sub.get("device", "none")
        if device not in ("cpu", "nvme", "none"):
            raise ConfigError(f"{path}: zero_optimization.{key}.device must be cpu, nvme or none, got {quote(device)}")
        knobs[field_name] = device != "none"
        if device == "nvme":
            notes.append(f"zero_optimization.{key}.device nvme: modelled as host (cpu) offload; the NVMe swap "
                         "buffers (aio_config) are not counted")
        pin = _bool(sub.get("pin_memory", False), f"zero_optimization.{key}.pin_memory", path)
        if device != "none" and pin:
            knobs["offload_pin_memory"] = True
    leaf = zero.get("leaf_module")
    if leaf is not None:  # runtime/zero/leaf_module_config.py: classes (replacing the defaults), names, suffixes
        if not isinstance(leaf, dict):
            raise ConfigError(f"{path}: zero_optimization.leaf_module must be an object")
        for key, field_name in (("classes", "leaf_classes"), ("names", "leaf_names"),
                                ("name_suffixes", "leaf_name_suffixes")):
            if key in leaf:
                v = leaf[key]
                v = [v] if isinstance(v, str) else v
                if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                    raise ConfigError(f"{path}: zero_optimization.leaf_module.{key} must be a list of strings")
                knobs[field_name] = tuple(dict.fromkeys(v))
    ignored = []
    for where, table, prefix in ((data, IGNORED_TOP, ""), (zero, ZERO_IGNORED, "zero_optimization.")):
        for key in where:
            if key in table:
                memory, why = table[key]
                if memory:
                    notes.append(f"{prefix}{key} not modelled: {why}")
                else:
                    ignored.append(f"{prefix}{key} ({why})")
    if ignored:
        notes.append("ds_config keys without a memory effect: " + "; ".join(ignored))

    recipe = None
    bf16, fp16 = _precision_enabled(data, "bf16", path), _precision_enabled(data, "fp16", path)
    auto = any(isinstance(data.get(k), dict) and data[k].get("enabled") == "auto" for k in ("bf16", "fp16"))
    if auto:
        notes.append("bf16/fp16 enabled \"auto\": filled from the Trainer's or Accelerate's mixed precision "
                     "(--training-args, --accelerate-config, or --precision)")
    if bf16 and fp16:
        raise ConfigError(f"{path}: bf16 and fp16 are both enabled (DeepSpeed: \"bfloat16 and fp16 modes cannot be "
                          "simultaneously enabled\", runtime/config.py)")
    if bf16:
        recipe = "deepspeed-bf16"
    elif fp16:
        recipe = "deepspeed-fp16"
    elif (bf16 is not None or fp16 is not None) and not auto:
        recipe = "fp32"
    optimizer = None
    if isinstance(data.get("optimizer"), dict):
        kind = str(data["optimizer"].get("type", "")).lower()
        optimizer = {"adamw": "adamw", "adam": "adam", "sgd": "sgd", "onebitadam": "adam", "lamb": "adam",
                     "fusedadam": "adam", "cpuadam": "adam"}.get(kind)
        if optimizer is None:
            unknown.append(f"optimizer.type={data['optimizer'].get('type')}")
    mb = data.get("train_micro_batch_size_per_gpu")
    ga = data.get("gradient_accumulation_steps")
    if mb not in (None, "auto"):
        mb = _int(mb, "train_micro_batch_size_per_gpu", path)
    if ga not in (None, "auto"):
        ga = _int(ga, "gradient_accumulation_steps", path)
    acc = _grad_accum_dtype(data, path, unknown)
    if acc is not None:
        knobs["grad_accum_dtype"] = acc
    comm = data.get("communication_data_type")
    if comm is not None:
        if str(comm).lower() not in _DTYPES:
            raise ConfigError(f"{path}: communication_data_type must be fp32, fp16 or bf16, got {quote(comm)}")
        knobs["communication_data_type"] = _DTYPES[str(comm).lower()]
    return DsConfig(path=str(path), stage=stage, knobs=knobs, recipe=recipe, optimizer=optimizer,
                    micro_batch=mb, grad_accum=ga, unknown_keys=tuple(unknown), notes=tuple(notes))


#: DtypeEnum's spellings (runtime/config_utils / utils/types.py): what data_types.grad_accum_dtype may say
_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "fp16": "fp16",
           "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "bf16": "bf16", "bfloat16": "bf16",
           "torch.bfloat16": "bf16"}


def _grad_accum_dtype(data: dict[str, Any], path: str, unknown: list[str]) -> str | None:
    section = data.get("data_types")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: data_types must be an object")
    unknown.extend(f"data_types.{k}" for k in section if k != "grad_accum_dtype")
    value = section.get("grad_accum_dtype")
    if value is None:
        return None
    if str(value).lower() not in _DTYPES:
        raise ConfigError(f"{path}: data_types.grad_accum_dtype must be fp32, fp16 or bf16, got {quote(value)}")
    return _DTYPES[str(value).lower()]


def _deprecated(zero: dict[str, Any], path: str) -> dict[str, Any]:
    """The zero_optimization section with its deprecated offload keys read as DeepSpeed reads them
    (zero/config.py: cpu_offload -> offload_optimizer {"device": "cpu"}, cpu_offload_param -> offload_param;
    false leaves no offload; the old key and its replacement together is DeepSpeed's assertion)."""
    out = dict(zero)
    for old, new in DEPRECATED_ZERO.items():
        if old not in zero:
            continue
        if new in zero:
            raise ConfigError(f"{path}: zero_optimization.{old} and {new} together: DeepSpeed refuses a deprecated "
                              f"parameter with its replacement (\"Cannot provide deprecated parameter '{old}' and "
                              f"replacing parameter '{new}' together\")")
        if _bool(zero[old], f"zero_optimization.{old}", path):
            out[new] = {"device": "cpu"}
    return out


def resolve_auto(knobs: dict[str, Any], hidden_size: int | None) -> dict[str, Any]:
    """Replace "auto" bucket values as the HF Trainer does; needs the model's hidden size."""
    out = dict(knobs)
    rules = {"reduce_bucket_size": lambda h: h * h, "prefetch_bucket_size": lambda h: int(0.9 * h * h),
             "param_persistence_threshold": lambda h: 10 * h}
    for key, value in knobs.items():
        if value != "auto":
            continue
        if key not in rules:
            raise ConfigError(f"\"auto\" is not resolvable for {key}; give a number")
        if not hidden_size:
            raise ConfigError(f"\"auto\" {key} needs the model's hidden size, which this model does not declare")
        out[key] = rules[key](hidden_size)
    return out
