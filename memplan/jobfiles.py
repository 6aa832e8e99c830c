"""The job's own files, read as the frameworks read them, into memplan's command-line options:

- an Accelerate config (`accelerate config`'s YAML: distributed_type, mixed_precision, num_processes,
  num_machines, fsdp_config, deepspeed_config), as accelerate 1.x's launcher and plugins read it
  (accelerate/utils/dataclasses.py FullyShardedDataParallelPlugin.__post_init__, set_mixed_precision,
  DeepSpeedPlugin);
- Hugging Face TrainingArguments as JSON or YAML (per_device_train_batch_size, gradient_accumulation_steps,
  bf16/fp16, gradient_checkpointing / activation_checkpointing and its kwargs' every_n_layers, optim, fsdp,
  fsdp_config, deepspeed), with
  transformers 5.x's defaults and rules (training_args.py: _process_fsdp_args, _apply_legacy_fsdp_to_config;
  the optimizer names of OptimizerNames).

Each reader returns a JobFile: the options it sets (the names of `memplan estimate`'s parameters), the notes of
what it could only approximate, and its path (the source the output names). The command line overrides a file;
TrainingArguments override the Accelerate config (the Trainer builds its Accelerator from them). Pure Python:
PyYAML (a transformers dependency) is imported only to read YAML.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from memplan.errors import ConfigError
from memplan.inputs import quote
from memplan.request import JobRequest


@dataclass
class JobFile:
    path: str
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _load(path: str, what: str) -> dict[str, Any]:
    """A JSON or YAML object from a regular file (one line naming the problem otherwise)."""
    from memplan.inputs import load_mapping_file

    return load_mapping_file(path, what)


def _flag(value: Any, key: str, path: str) -> bool:
    """A boolean as accelerate's str_to_bool and pydantic read it (true/false, 1/0, yes/no, on/off)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "1", "0", "on", "off",
                                                             "y", "n", "t", "f"):
        return value.strip().lower() in ("true", "yes", "1", "on", "y", "t")
    raise ConfigError(f"{path}: {key} must be true or false, got {quote(value)}")


def _count(value: Any, key: str, path: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{path}: {key} must be an integer of at least {low}, got {quote(value)}")
    return value


def _near(path: str, ref: str) -> str:
    """A file a config names: as given (the launcher's working directory), else beside the config."""
    p = Path(ref)
    if p.is_absolute() or p.exists():
        return str(p)
    beside = Path(path).resolve().parent / p
    return str(beside) if beside.exists() else str(p)


#: TrainingArguments.optim (transformers 5.x OptimizerNames) -> (memplan optimizer, optimizer impl, note)
OPTIM = {"adamw_torch": ("adamw", "foreach", None), "adamw_torch_fused": ("adamw", "fused", None),
         "adafactor": ("adafactor", None, None),
         "adamw_bnb_8bit": ("adam8bit", None, None), "adamw_8bit": ("adam8bit", None, None),
         "paged_adamw_8bit": ("paged_adamw_8bit", None, None),
         "paged_adamw_32bit": ("paged_adamw_32bit", None, None),
         "apollo_adamw": ("apollo-adamw", None, "optim apollo_adamw: rank 128, random projection, channel scaling "
                          "(the Trainer's defaults) on the attention and MLP linear weights (optim_target_modules "
                          "[r\".*.attn.*\", r\".*.mlp.*\"]); other optim_args or target modules are not read"),
         "galore_adamw": ("galore-adamw", None, "optim galore_adamw: rank 128, update_proj_gap 200, scale 0.25, "
                          "proj_type std (the Trainer's defaults) on the attention and MLP linear weights "
                          "(optim_target_modules [r\".*.attn.*\", r\".*.mlp.*\"]); other optim_args or target "
                          "modules are not read"),
         "sgd": ("sgd", None, "optim sgd: torch.optim.SGD without momentum unless optim_args sets it; a momentum "
                             "buffer is counted (an upper bound)")}
#: the names transformers accepts that memplan does not model (a clear error, not a guess)
OPTIM_NOT_MODELLED = ("adamw_torch_xla", "adamw_torch_npu_fused", "adamw_anyprecision", "adamw_torch_4bit",
                      "adamw_torch_8bit", "ademamix", "adagrad", "ademamix_8bit", "lion_8bit", "lion_32bit",
                      "paged_ademamix_32bit", "paged_ademamix_8bit", "paged_lion_32bit", "paged_lion_8bit",
                      "rmsprop", "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise", "galore_adamw_8bit_layerwise",
                      "galore_adafactor_layerwise", "lomo", "adalomo", "grokadamw", "schedule_free_radam",
                      "schedule_free_adamw", "schedule_free_sgd", "apollo_adamw_layerwise",
                      "stable_adamw")


def _optim(name: Any, path: str, job: JobFile) -> None:
    if not isinstance(name, str):
        raise ConfigError(f"{path}: optim must be an optimizer name, got {quote(name)}")
    if name in OPTIM_NOT_MODELLED:
        raise ConfigError(f"{path}: optim {quote(name)} is not modelled by memplan; modelled: {', '.join(OPTIM)}")
    if name not in OPTIM:
        raise ConfigError(f"{path}: optim {quote(name)} is not an optimizer transformers accepts (OptimizerNames); "
                          f"memplan models {', '.join(OPTIM)}")
    opt, impl, note = OPTIM[name]
    job.values["optimizer"] = opt
    if impl:
        job.values["optimizer_impl"] = impl
    if note:
        job.notes.append(f"{path}: {note}")


#: FSDP1 sharding strategies (accelerate FSDP_SHARDING_STRATEGY order: 1-5) -> memplan strategy
_FSDP1 = {"FULL_SHARD": "fsdp-full", "SHARD_GRAD_OP": "fsdp-grad-op", "NO_SHARD": "fsdp-no-shard",
          "HYBRID_SHARD": "hsdp", "HYBRID_SHARD_ZERO2": None}
_FSDP_MIXED = ("Accelerate's FSDP mixed precision reduces in bf16 (MixedPrecision(param_dtype=bf16, "
               "reduce_dtype=bf16), accelerate set_mixed_precision) under autocast; modelled as fsdp-bf16, whose "
               "fp32 reduce-scatter buffers are twice as large")


class _JobFileValue(str):
    """A value only a job file sets (options.py resolves it once the model is known; the same text given on the
    command line is a plain str and is refused as any unknown value is)."""


#: the units Accelerate's FSDP2 makes with TRANSFORMER_BASED_WRAP, resolved by options.py with the model
ACCELERATE_FSDP2_WRAP = _JobFileValue("accelerate-fsdp2")


class _Fsdp2SizeWrap(_JobFileValue):
    """Accelerate's FSDP2 SIZE_BASED_WRAP with min_num_params (options.py resolves it with the model)."""

    min_num_params: int


class _Fsdp2ClassWrap(_JobFileValue):
    """Accelerate's FSDP2 TRANSFORMER_BASED_WRAP with fsdp_transformer_layer_cls_to_wrap (options.py resolves it)."""

    classes: list[str]


def accelerate_fsdp2_classes(classes: list[str]) -> _Fsdp2ClassWrap:
    v = _Fsdp2ClassWrap("accelerate-fsdp2-class:" + ",".join(classes))
    v.classes = classes
    return v


def _class_names(value: Any, path: str) -> list[str]:
    """fsdp_transformer_layer_cls_to_wrap: a comma-separated string (Accelerate) or a list (the Trainer's)."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else None
    if items is None or not all(isinstance(x, str) for x in items):
        raise ConfigError(f"{path}: transformer_layer_cls_to_wrap must be class names, got {quote(value)}")
    names = list(dict.fromkeys(x.strip() for x in items if x.strip()))
    if not names:
        raise ConfigError(f"{path}: transformer_layer_cls_to_wrap names no class")
    return names


def accelerate_fsdp2_size(n: int) -> _Fsdp2SizeWrap:
    v = _Fsdp2SizeWrap(f"accelerate-fsdp2-size:{n}")
    v.min_num_params = n
    return v


def _section(d: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    """A nested mapping of settings (fsdp_config, deepspeed_config, parallelism_config): absent or empty is {}."""
    value = d.get(key)
    if value is None or value == "":
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {key} must be a mapping of settings, got {quote(value)}")
    return value


def _version(value: Any, path: str) -> int:
    """fsdp_version: 1 or 2, as an integer or its digit (accelerate int()s the launcher's string; the Trainer
    compares with 2); anything else (2.5, "abc", null, a list) is refused."""
    if isinstance(value, bool) or not (value in (1, 2) and isinstance(value, int)
                                       or isinstance(value, str) and value.strip() in ("1", "2")):
        raise ConfigError(f"{path}: fsdp_version must be 1 or 2, got {quote(value)}")
    return int(value)


class _FsdpSection(NamedTuple):
    """An FSDP section as Accelerate's config or the Trainer's fsdp_config gives it (fsdp_ prefixes dropped)."""

    version: int
    reshard: Any  #: reshard_after_forward (FSDP2), or FSDP1's sharding strategy in the Trainer's legacy string
    strategy: Any  #: sharding_strategy (FSDP1)
    offload: bool
    checkpointing: bool
    wrap: Any  #: auto_wrap_policy
    min_params: Any = 0
    classes: Any = None  #: transformer_layer_cls_to_wrap


def _fsdp(job: JobFile, path: str, section: _FsdpSection) -> None:
    version, reshard, strategy, offload, checkpointing, wrap, min_params, classes = section
    if version not in (1, 2):
        raise ConfigError(f"{path}: fsdp version must be 1 or 2, got {quote(version)}")
    job.values["fsdp_version"] = version
    if version == 2:
        raf = True if reshard is None else _flag(reshard, "reshard_after_forward", path)
        job.values["strategy"] = "fsdp-full" if raf else "fsdp-grad-op"
    else:
        name = strategy if strategy is not None else reshard if reshard is not None else "FULL_SHARD"
        if isinstance(name, int) or (isinstance(name, str) and name.isdigit()):
            k = int(name)
            if not 1 <= k <= 5:
                raise ConfigError(f"{path}: FSDP sharding strategy {quote(name)} is not 1-5")
            name = list(_FSDP1)[k - 1]
        key = str(name).upper()
        if key not in _FSDP1:
            raise ConfigError(f"{path}: FSDP sharding strategy {quote(name)} is not one of {', '.join(_FSDP1)}")
        if _FSDP1[key] is None:
            raise ConfigError(f"{path}: FSDP {key} (HSDP with SHARD_GRAD_OP inside a node) is not modelled")
        job.values["strategy"] = _FSDP1[key]
    if offload:
        job.values["cpu_offload"] = True
    if checkpointing:
        job.values["recompute"] = "full"
    wrap = str(wrap).upper()
    if wrap == "NO_WRAP":  # only the root (FSDP2: fsdp2_prepare_auto_wrap_policy; FSDP1: no auto_wrap_policy)
        job.values["fsdp_wrap"] = "none"
        if version == 2:
            job.notes.append(f"{path}: FSDP2 NO_WRAP: Accelerate 1.15 (fsdp2_prepare_model) still makes the input "
                             "embedding and the final norm with the head their own units; memplan keeps them in the "
                             "root (--fsdp-wrap none), which over-counts the embedding after forward")
    elif wrap == "TRANSFORMER_BASED_WRAP" and classes is not None:
        # fsdp_transformer_layer_cls_to_wrap (Accelerate: comma-separated; the Trainer's list): those classes'
        # modules, resolved with the model by options.py (the decoder layer's class is --fsdp-wrap block)
        names = _class_names(classes, path)
        job.values["fsdp_wrap"] = accelerate_fsdp2_classes(names) if version == 2 else "class:" + ",".join(names)
    elif wrap == "TRANSFORMER_BASED_WRAP" and version == 2:
        # Accelerate 1.15's fsdp2_prepare_model: each decoder layer, then the input embedding its own unit
        # (resharded after forward) and [final norm, head] one unit not resharded after forward (a tied embedding
        # joins that unit): --fsdp-wrap block+embeddings for an untied model, block for a tied one (options.py
        # resolves ACCELERATE_FSDP2_WRAP once the model is known)
        job.values["fsdp_wrap"] = ACCELERATE_FSDP2_WRAP
    elif wrap == "SIZE_BASED_WRAP":
        # FullyShardedDataParallelPlugin.set_auto_wrap_policy: size_based_auto_wrap_policy with min_num_params
        # when it is above zero, else no policy at all ("If zero, we silently ignore it")
        n = _count(min_params, "min_num_params", path, low=0)
        if n == 0:
            job.values["fsdp_wrap"] = "none"
            job.notes.append(f"{path}: SIZE_BASED_WRAP with min_num_params 0: Accelerate sets no auto-wrap policy "
                             "(only the root is wrapped)")
        elif version == 1:
            job.values["fsdp_wrap"] = f"size:{n}"
        else:
            job.values["fsdp_wrap"] = accelerate_fsdp2_size(n)
    elif wrap != "TRANSFORMER_BASED_WRAP":
        raise ConfigError(f"{path}: FSDP auto-wrap policy {quote(wrap)} is not one of TRANSFORMER_BASED_WRAP, "
                          "SIZE_BASED_WRAP, NO_WRAP")


def _checkpointing_kwargs(job: JobFile, path: str, kw: Any) -> str:
    """The recompute the Trainer's activation_checkpointing_kwargs ask for (trainer.py: every_n_layers and offload
    popped for activation_checkpointing_enable, the rest passed to torch.utils.checkpoint.checkpoint): every
    every_n_layers-th decoder layer checkpointed; offload's pinned host copies are noted (the figure keeps the
    checkpointed inputs on the device, an upper bound)."""
    if kw is None:
        return "full"
    if isinstance(kw, str):  # TrainingArguments takes a JSON string too
        from memplan.inputs import load_json

        kw = load_json(kw, f"{path}: activation_checkpointing_kwargs", "JSON object")
    if not isinstance(kw, dict):
        raise ConfigError(f"{path}: activation_checkpointing_kwargs must be a mapping, got {quote(kw)}")
    every = _count(kw.get("every_n_layers", 1), "activation_checkpointing_kwargs.every_n_layers", path)
    if kw.get("offload") is not None and _flag(kw["offload"], "activation_checkpointing_kwargs.offload", path):
        job.notes.append(f"{path}: activation_checkpointing_kwargs.offload holds the checkpointed layers' inputs in "
                         "pinned host memory (torch.autograd.graph.save_on_cpu); memplan keeps them on the GPU, "
                         "an upper bound by about layers x micro-batch x sequence x hidden x 2 bytes")
    if kw.get("use_reentrant") is not None and _flag(kw["use_reentrant"], "use_reentrant", path):
        job.notes.append(f"{path}: use_reentrant=True checkpointing is modelled as the non-reentrant kind the "
                         "Trainer uses by default (the same saved inputs; the recompute's transients may differ)")
    return "full" if every == 1 else f"every:{every}"


def _accelerate_fp8(job: JobFile, path: str, d: dict[str, Any], dist: str) -> str:
    """mixed_precision fp8 with Accelerate's torchao backend (accelerator.py _prepare_ao, utils/ao.py
    convert_model_to_fp8_ao): AORecipeKwargs' Float8LinearConfig (tensorwise), every nn.Linear but the first and
    the last, under bf16 autocast as for bf16 (utils/modeling.py get_mixed_precision_context_manager: "bf16",
    "fp8"). Returns the mixed precision the rest of the config is read with."""
    fp8 = _section(d, "fp8_config", path) if d.get("fp8_config") is not None else {}
    backend = str(fp8.get("backend", "AO")).upper()
    if backend != "AO":
        raise ConfigError(f"{path}: mixed_precision fp8 with fp8_config.backend {quote(fp8.get('backend'))}: "
                          "Transformer Engine's and MS-AMP's float8 are not modelled; torchao's (backend AO) is")
    if dist == "DEEPSPEED":
        raise ConfigError(f"{path}: mixed_precision fp8 under DeepSpeed (Accelerate runs MS-AMP there) is not "
                          "modelled")
    if dist == "FSDP" and _flag(fp8.get("enable_fsdp_float8_all_gather", True),
                                "fp8_config.enable_fsdp_float8_all_gather", path):
        # AORecipeKwargs: ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER defaults to True
        job.values["float8_all_gather"] = True
    if "backend" not in fp8:
        job.notes.append(f"{path}: mixed_precision fp8 without fp8_config.backend: Accelerate takes torchao where "
                         "it is installed (else Transformer Engine); modelled as torchao's")
    job.values["float8"], job.values["float8_keep"] = "tensorwise", "first-last"
    return "bf16"


def read_accelerate(path: str) -> JobFile:
    """An `accelerate config` YAML (or JSON) file."""
    d = _load(path, "Accelerate config")
    job = JobFile(path)
    dist = str(d.get("distributed_type", "NO")).upper()
    mixed = str(d.get("mixed_precision", "no")).lower()
    if mixed not in ("no", "bf16", "fp16", "fp8"):
        raise ConfigError(f"{path}: mixed_precision must be no, bf16, fp16 or fp8, got {quote(d.get('mixed_precision'))}")
    if mixed == "fp8":
        mixed = _accelerate_fp8(job, path, d, dist)
    procs = _count(d.get("num_processes", 1), "num_processes", path)
    machines = _count(d.get("num_machines", 1), "num_machines", path)
    if procs % machines:
        raise ConfigError(f"{path}: num_processes {procs} is not a multiple of num_machines {machines}")
    job.values["gpus"] = procs
    job.values["gpus_per_node"] = procs // machines
    if dist in ("NO", "MULTI_GPU"):
        job.values["strategy"] = "single" if procs == 1 else "ddp"
        # autocast over the model as the script loads it (transformers 5: its config's dtype): precision_for
        job.values["_mixed"] = mixed
    elif dist == "FSDP":
        f = {k.removeprefix("fsdp_"): v for k, v in _section(d, "fsdp_config", path).items()}
        _fsdp(job, path, _FsdpSection(
            _version(f.get("version", 1), path), f.get("reshard_after_forward"), f.get("sharding_strategy"),
            _flag(f.get("offload_params", False), "fsdp_offload_params", path),
            _flag(f.get("activation_checkpointing", False), "fsdp_activation_checkpointing", path),
            # unset: accelerate's FullyShardedDataParallelPlugin.__post_init__ reads FSDP_AUTO_WRAP_POLICY, which
            # the launcher sets only from the config, default "NO_WRAP"
            f.get("auto_wrap_policy", "NO_WRAP"),
            # the launcher's --fsdp_min_num_params default (commands/launch.py: int(1e8))
            f.get("min_num_params", 100_000_000), f.get("transformer_layer_cls_to_wrap")))
        job.values["precision"] = "fp32" if mixed == "no" else "fsdp-bf16"
        if mixed != "no":
            job.notes.append(f"{path}: {_FSDP_MIXED}")
    elif dist == "DEEPSPEED":
        _deepspeed_plugin(job, path, _section(d, "deepspeed_config", path), mixed)
    else:
        raise ConfigError(f"{path}: distributed_type {quote(d.get('distributed_type'))} is not modelled (NO, MULTI_GPU, "
                          "FSDP, DEEPSPEED are)")
    if mixed == "fp16" and dist != "DEEPSPEED":
        job.notes.append(f"{path}: fp16 autocast is modelled as bf16's (the same bytes)")
    _parallelism(job, path, _section(d, "parallelism_config", path))
    return job


def _parallelism(job: JobFile, path: str, pc: dict[str, Any]) -> None:
    """Accelerate's parallelism_config (accelerate/parallelism_config.py ParallelismConfig; the keys as `accelerate
    config` writes them, parallelism_config_tp_size, or bare): tp_size runs transformers' own tensor parallelism
    (the model's tp_plan; its head is colwise_gather_output: the logits gathered whole, no loss parallelism),
    dp_replicate_size > 1 with dp_shard_size is HSDP; cp_size runs torch's context_parallel ring attention over
    that many ranks (Accelerate's TorchContextParallelConfig; FSDP over dp_shard x cp, as memplan's --cp)."""
    if not isinstance(pc, dict):
        raise ConfigError(f"{path}: parallelism_config must be a mapping")

    def get(k: str) -> Any:
        return pc.get(f"parallelism_config_{k}", pc.get(k))

    tp, cp = get("tp_size"), get("cp_size")
    rep, shard = get("dp_replicate_size"), get("dp_shard_size")
    if cp is not None and _count(cp, "parallelism_config.cp_size", path) > 1:
        job.values["cp"] = int(cp)
        strategy = str((pc.get("cp_handler") or {}).get("cp_comm_strategy", "allgather")
                       if isinstance(pc.get("cp_handler"), dict) else "allgather")
        job.notes.append(f"{path}: cp_size {cp}: torch's ring attention over {cp} ranks (k/v all-gathered"
                         + ("; cp_comm_strategy alltoall passes them rank to rank instead: the all-gathered buffer "
                            "counted is an upper bound)" if strategy == "alltoall" else ")"))
    if tp is not None and _count(tp, "parallelism_config.tp_size", path) > 1:
        job.values["tp"] = int(tp)
        job.values["loss_parallel"] = False
        job.notes.append(f"{path}: tp_size {tp}: transformers' tensor parallelism (the model's tp_plan; the logits "
                         "gathered whole for the loss)")
    if rep is not None and _count(rep, "parallelism_config.dp_replicate_size", path) > 1:
        job.values["strategy"] = "hsdp"
        if shard is not None:
            job.values["hsdp_shard_size"] = _count(shard, "parallelism_config.dp_shard_size", path)


def _deepspeed_plugin(job: JobFile, path: str, ds: dict[str, Any], mixed: str) -> None:
    """accelerate's DeepSpeedPlugin: a config file, or the launcher's few keys; mixed_precision fills the file's
    "auto" (and absent) precision (set_mixed_precision, fill_match must_match=False)."""
    from memplan import dsconfig

    if ds.get("deepspeed_config_file"):
        job.values["deepspeed"] = _near(path, str(ds["deepspeed_config_file"]))
        if dsconfig.load(job.values["deepspeed"]).recipe is not None:
            return
    else:
        stage = ds.get("zero_stage", 2)
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ConfigError(f"{path}: deepspeed_config.zero_stage must be 0, 1, 2 or 3, got {quote(stage)}")
        job.values["stage"] = stage
        for key, knob in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_param")):
            dev = str(ds.get(key, "none")).lower()
            if dev not in ("none", "cpu", "nvme"):
                raise ConfigError(f"{path}: deepspeed_config.{key} must be none, cpu or nvme, got {quote(ds.get(key))}")
            if dev != "none":
                job.values[knob] = True
        if "gradient_accumulation_steps" in ds:
            job.values["grad_accum"] = _count(ds["gradient_accumulation_steps"], "gradient_accumulation_steps", path)
    job.values["precision"] = {"no": "fp32", "bf16": "deepspeed-bf16", "fp16": "deepspeed-fp16"}[mixed]


def read_training_args(path: str) -> JobFile:
    """Hugging Face TrainingArguments as a JSON or YAML mapping (the fields memplan reads; others ignored)."""
    d = _load(path, "TrainingArguments file")
    job = JobFile(path)
    job.values["micro_batch"] = _count(d.get("per_device_train_batch_size", 8), "per_device_train_batch_size",
                                       path)  # transformers' default: 8
    job.values["grad_accum"] = _count(d.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps", path)
    bf16 = _flag(d.get("bf16", False), "bf16", path)
    fp16 = _flag(d.get("fp16", False), "fp16", path)
    if bf16 and fp16:
        raise ConfigError(f"{path}: bf16 and fp16 are both set (TrainingArguments refuses them together)")
    ckpt = d.get("activation_checkpointing", d.get("gradient_checkpointing"))
    if ckpt is not None and _flag(ckpt, "gradient_checkpointing", path):
        job.values["recompute"] = _checkpointing_kwargs(job, path, d.get(
            "activation_checkpointing_kwargs", d.get("gradient_checkpointing_kwargs")))
    _optim(d.get("optim", "adamw_torch_fused"), path, job)
    if _flag(d.get("torch_compile", False), "torch_compile", path):
        # the Trainer compiles the whole model, its loss inside, in one graph: not modelled (--compile blocks is
        # the per-block compile)
        raise ConfigError(f"{path}: torch_compile (the whole model in one graph) is not modelled; memplan models "
                          "torch.compile of each transformer block (--compile blocks)")
    if d.get("ddp_bucket_cap_mb") is not None:
        # the Trainer hands it to DDP (transformers trainer.py: ddp_kwargs["bucket_cap_mb"])
        job.values["bucket_cap_mb"] = _count(d["ddp_bucket_cap_mb"], "ddp_bucket_cap_mb", path)
    fsdp, ds = d.get("fsdp"), d.get("deepspeed")
    if fsdp and ds:
        raise ConfigError(f"{path}: fsdp and deepspeed are both set (the Trainer takes one)")
    if fsdp:
        _training_fsdp(job, path, fsdp, d.get("fsdp_config"), bf16 or fp16)
    elif ds:
        _training_deepspeed(job, path, ds, d, bf16, fp16)
    else:
        # the recipe follows the framework the job runs under (an Accelerate config's, or the command line's):
        # precision_for() decides once the strategy is known
        job.values["_mixed"] = "bf16" if bf16 else "fp16" if fp16 else "no"
        if fp16:
            job.notes.append(f"{path}: fp16 is modelled as bf16 (the same bytes)")
    return job


#: the model dtypes transformers 5 loads a checkpoint in by default that are not fp32 (from_pretrained's
#: dtype="auto" takes the config's dtype: modeling_utils.py _get_dtype)
HALF_DTYPES = ("bfloat16", "float16")


def precision_for(values: dict[str, Any], model_dtype: str | None = None) -> str:
    """The recipe a Trainer's mixed precision (values["_mixed"]) gives under the job's framework: DeepSpeed's
    bf16/fp16 optimizer (Accelerate's DeepSpeedPlugin.set_mixed_precision), FSDP's MixedPrecision (approximated
    by fsdp-bf16, see _FSDP_MIXED), else the model as loaded: transformers 5's from_pretrained loads it in its
    config's dtype (``model_dtype``). A bf16 checkpoint with bf16=True trains as bf16-autocast (bf16 weights,
    gradients and AdamW states under autocast); a 16-bit checkpoint without mixed precision trains in its own dtype
    (pure-bf16's bytes); an fp32 one as torch-amp (fp32 weights, autocast) or fp32. A 16-bit checkpoint under the
    other 16-bit autocast (an fp16 model with bf16=True, a bf16 one with fp16=True: the same bytes) is
    fp16-bf16-autocast, autocast copying every weight. fp16=True on an fp16 checkpoint fails in GradScaler; it is
    counted as torch-amp, as a script that loads fp32 for it runs (mixed_precision_note says so)."""
    mixed = values.get("_mixed", "no")
    strategy = values.get("strategy") or ""
    if values.get("deepspeed") or values.get("stage") is not None or strategy.startswith("zero"):
        return {"no": "fp32", "bf16": "deepspeed-bf16", "fp16": "deepspeed-fp16"}[mixed]
    if strategy.startswith("fsdp") or strategy == "hsdp":
        return "fp32" if mixed == "no" else "fsdp-bf16"
    if mixed == "no":
        return "pure-bf16" if model_dtype in HALF_DTYPES else "fp32"
    if model_dtype == "bfloat16" and mixed == "bf16":
        return "bf16-autocast"
    if (model_dtype, mixed) in (("float16", "bf16"), ("bfloat16", "fp16")):
        return "fp16-bf16-autocast"
    return "torch-amp"


def mixed_precision_note(where: str, mixed: str, model_dtype: str | None, recipe: str) -> str | None:
    """What a Trainer's mixed precision becomes on a model loaded in its config's dtype (precision_for)."""
    loaded = (f"{where}'s {'no mixed precision' if mixed == 'no' else mixed} on a model whose config stores "
              f"{model_dtype}: transformers 5 loads it so (from_pretrained dtype='auto')")
    if recipe == "bf16-autocast":
        return (f"precision: {loaded}, and Accelerate's autocast (the Trainer's) leaves its weights, gradients and "
                "AdamW states in bf16 (bf16-autocast); a script that loads dtype=torch.float32 trains as --precision torch-amp")
    if recipe == "pure-bf16":
        return (f"precision: {loaded} and trains it in that dtype, optimizer states too (pure-bf16's bytes); a "
                "script that loads dtype=torch.float32 trains as --precision fp32")
    if recipe == "fp16-bf16-autocast":
        return (f"precision: {loaded}; autocast to {mixed} copies every {model_dtype} weight for its matmuls and "
                "saves the copies, and the residual stream adds the two dtypes into fp32 (fp16-bf16-autocast"
                + (", traced as float16 weights under bf16: the same bytes" if mixed == "fp16" else "")
                + "); a script that loads dtype=torch.float32 trains as --precision torch-amp")
    if recipe == "torch-amp" and model_dtype in HALF_DTYPES:
        return (f"precision: {loaded}, but fp16=True on float16 weights fails in GradScaler ('Attempting to "
                "unscale FP16 gradients'): counted as a script that loads dtype=torch.float32 runs it (torch-amp)")
    return None


def _training_fsdp(job: JobFile, path: str, fsdp: Any, cfg: Any, mixed: bool) -> None:
    """transformers' _process_fsdp_args: fsdp_config (a mapping or a JSON file) with its fsdp_ prefixes dropped,
    the legacy fsdp string / list translated (_apply_legacy_fsdp_to_config); version 2 by default."""
    if isinstance(cfg, str):
        cfg = _load(_near(path, cfg), "fsdp_config")
    if cfg is not None and not isinstance(cfg, dict):
        raise ConfigError(f"{path}: fsdp_config must be a mapping or a JSON file, got {quote(cfg)}")
    f = {k.removeprefix("fsdp_"): v for k, v in (cfg or {}).items()}
    version = _version(f.get("version", 2), path)
    items = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, list) else []
    if not all(isinstance(x, str) for x in items):
        raise ConfigError(f"{path}: fsdp must be option names (full_shard, offload, auto_wrap, ...), got {quote(fsdp)}")
    for item in items:
        if item in ("offload",):
            f["cpu_offload"] = True
        elif item.upper() in _FSDP1:
            if version == 2:
                if item not in ("full_shard", "shard_grad_op"):
                    raise ConfigError(f"{path}: fsdp {quote(item)} is only available with FSDP1 (transformers: set "
                                      "fsdp_config version 1)")
                f.setdefault("reshard_after_forward", item == "full_shard")
            else:
                f.setdefault("reshard_after_forward", item)
        elif item != "auto_wrap":
            raise ConfigError(f"{path}: fsdp option {quote(item)} is not one of full_shard, shard_grad_op, no_shard, "
                              "hybrid_shard, hybrid_shard_zero2, offload, auto_wrap")
    _fsdp(job, path, _FsdpSection(
        version, f.get("reshard_after_forward"), None,
        _flag(f.get("cpu_offload", False), "fsdp_config.cpu_offload", path),
        _flag(f.get("activation_checkpointing", False), "fsdp_config.activation_checkpointing", path),
        # unset: transformers' _process_fsdp_args defaults it to FSDP_AUTO_WRAP_POLICY[0], TRANSFORMER_BASED_WRAP
        f.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP"),
        # training_args.py: fsdp_config["min_num_params"] defaults to 0
        f.get("min_num_params", 0), f.get("transformer_layer_cls_to_wrap")))
    job.values["precision"] = "fsdp-bf16" if mixed else "fp32"
    if mixed:
        job.notes.append(f"{path}: {_FSDP_MIXED}")


def _training_deepspeed(job: JobFile, path: str, ds: Any, d: dict[str, Any], bf16: bool, fp16: bool) -> None:
    """The Trainer's DeepSpeed config: its "auto" values filled from the arguments and explicit ones checked
    against them (integrations/deepspeed.py trainer_config_process: fill_match, a mismatch is its error)."""
    from memplan import dsconfig

    if not isinstance(ds, str):
        raise ConfigError(f"{path}: deepspeed must be the path of a DeepSpeed config file")
    ds_path = _near(path, ds)
    job.values["deepspeed"] = ds_path
    f = dsconfig.load(ds_path)
    wanted = {"micro_batch": ("train_micro_batch_size_per_gpu", f.micro_batch),
              "grad_accum": ("gradient_accumulation_steps", f.grad_accum)}
    for name, (key, in_file) in wanted.items():
        if in_file not in (None, "auto") and in_file != job.values[name]:
            raise ConfigError(f"{path}: {ds_path} sets {key} {in_file} but the TrainingArguments give "
                              f"{job.values[name]} (the Trainer refuses DeepSpeed config values that mismatch "
                              "TrainingArguments)")
    recipe = "deepspeed-bf16" if bf16 else "deepspeed-fp16" if fp16 else "fp32"
    if f.recipe is not None and f.recipe != recipe:
        raise ConfigError(f"{path}: {ds_path} enables {f.recipe} but the TrainingArguments give bf16={bf16}, "
                          f"fp16={fp16} (the Trainer refuses the mismatch)")
    job.values["precision"] = recipe
    if f.optimizer is not None:  # the Trainer builds the DeepSpeed config's optimizer, not optim's
        job.values.pop("optimizer", None)
        job.values.pop("optimizer_impl", None)


def merge(files: list[JobFile]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """The options the files set, later files over earlier ones; their sources; the files' notes and where one
    overrode another."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []
    for job in files:
        for k, v in job.values.items():
            if k in values and values[k] != v:
                notes.append(f"{k}: {job.path} {quote(v)} overrides {sources[k]} {quote(values[k])}")
            values[k], sources[k] = v, job.path
        notes.extend(job.notes)
    if "stage" in values and "strategy" in values:  # the later file decides
        drop = "strategy" if sources["stage"] == files[-1].path else "stage"
        values.pop(drop)
        sources.pop(drop)
    return values, sources, notes


def _with_files(given: dict[str, Any], explicit: set[str], model_dtype: str | None = None) -> tuple[dict[str, Any], dict[str, str], list[str],
                                                                    list[str]]:
    """The options with the job files' values where the command line gave none; the files' sources; notes;
    the files read."""
    files = []
    if given.get("accelerate_config"):
        files.append(read_accelerate(given["accelerate_config"]))
    if given.get("training_args"):
        files.append(read_training_args(given["training_args"]))
    values, sources, notes = merge(files)
    values = _framework_of_command_line(given, explicit, values, sources, notes, model_dtype)
    out = dict(given)
    used: dict[str, str] = {}
    for k, v in values.items():
        strategy_given = k in ("stage", "strategy") and ({"stage", "strategy"} & explicit)
        if k in explicit or strategy_given:
            if not strategy_given and given[k] != v:
                notes.append(f"{k}: command line {quote(given[k])} overrides {sources[k]} {quote(v)}")
            elif strategy_given:
                notes.append(f"strategy: the command line's overrides {sources[k]} {k} {quote(v)}")
            continue
        out[k], used[k] = v, sources[k]
    if "stage" in used:
        out["strategy"] = None
    mixed = out.pop("_mixed", None)
    used.pop("_mixed", None)
    if mixed is not None:  # the Trainer's bf16/fp16, under the framework the job runs with
        recipe = precision_for({**out, "_mixed": mixed}, model_dtype)
        why = mixed_precision_note(sources["_mixed"], mixed, model_dtype, recipe)
        if why and "precision" not in explicit:
            notes.append(why)
        if "precision" in explicit:
            if given["precision"] != recipe:
                notes.append(f"precision: command line {quote(given['precision'])} overrides {sources['_mixed']} "
                             f"{quote(recipe)}")
        else:
            if "precision" in used and out["precision"] != recipe:
                notes.append(f"precision: {sources['_mixed']} {quote(recipe)} overrides {used['precision']} "
                             f"{quote(out['precision'])}")
            out["precision"], used["precision"] = recipe, sources["_mixed"]
    return out, used, notes, [f.path for f in files]


#: the settings a job file gives that belong to one framework (this module): dropped, with a note, where the
#: command line's --stage / --strategy runs the job under another framework than the file's
FRAMEWORK_KEYS = {"fsdp": ("fsdp_wrap", "fsdp_version", "cpu_offload", "hsdp_shard_size"),
                  "deepspeed": ("deepspeed", "offload_optimizer", "offload_param")}


def _family(stage: Any, strategy: Any) -> str:
    if stage is not None or str(strategy or "").startswith("zero") and strategy != "zero-optimizer":
        return "deepspeed"
    if str(strategy or "").startswith("fsdp") or strategy == "hsdp":
        return "fsdp"
    return "torch"


def _framework_of_command_line(given: dict[str, Any], explicit: set[str], values: dict[str, Any],
                               sources: dict[str, str], notes: list[str],
                               model_dtype: str | None = None) -> dict[str, Any]:
    """Where the command line's --stage / --strategy runs the job under another framework than its files', the
    files' settings of their framework no longer apply (an Accelerate FSDP config's wrap policy under --stage 3):
    they are dropped with a note, and a precision the files gave follows the command line's framework with the
    same mixed precision (precision_for)."""
    if not ({"stage", "strategy"} & explicit) or not ({"stage", "strategy", "deepspeed"} & set(values)):
        return values
    theirs = _family(values.get("stage"), values.get("strategy")) if "deepspeed" not in values else "deepspeed"
    ours = _family(given.get("stage") if "stage" in explicit else None,
                   given.get("strategy") if "strategy" in explicit else None)
    if theirs == ours:
        return values
    out = dict(values)
    dropped = [k for k in FRAMEWORK_KEYS.get(theirs, ()) if k in out]
    for k in dropped:
        out.pop(k)
    if dropped:
        where = sorted({sources[k] for k in dropped})
        notes.append(f"{', '.join(where)}: its {theirs} settings ({', '.join(dropped)}) do not apply to the command "
                     f"line's {ours} strategy; left out")
    if "precision" in out and "_mixed" not in out:
        mixed = {"fp32": "no", "deepspeed-fp16": "fp16"}.get(str(out["precision"]), "bf16")
        recipe = precision_for({"stage": given.get("stage") if "stage" in explicit else None,
                                         "strategy": given.get("strategy") if "strategy" in explicit else None,
                                         "_mixed": mixed}, model_dtype)
        if recipe != out["precision"]:
            notes.append(f"precision: {sources['precision']}'s {quote(out['precision'])} is {theirs}'s; the "
                         f"command line's {ours} strategy runs the same mixed precision as {quote(recipe)}")
            out["precision"] = recipe
    return out


def merged(request: JobRequest, hidden_size: int | None,
           model_dtype: str | None = None) -> tuple[JobRequest, list[str], list[str]]:
    """The one place a job's values are merged: the request as given (its sources: "command line" for each field
    given), then its TrainingArguments and Accelerate config (_with_files), then its DeepSpeed config
    (dsconfig.DsConfig.partial: "auto" sizes from the model's ``hidden_size``), each filling what the ones before
    left unset; memplan's defaults fill the rest (options.resolve). Returns the merged request, whose sources name
    the file each value came from, the notes (what a file could only approximate, where one value overrode
    another's) and the files read."""
    from memplan import dsconfig
    from memplan.errors import SettingsError
    from memplan.strategies import STAGE_TO_STRATEGY

    f = request.files
    if not (f.training_args or f.accelerate_config or f.deepspeed) and request.memory.pin_memory is None:
        stage, strategy = request.training.stage, request.training.strategy
        if stage is not None and strategy is not None:
            raise SettingsError("give --stage or --strategy, not both")
        if stage is not None and stage not in STAGE_TO_STRATEGY:
            raise SettingsError(f"--stage must be 0, 1, 2 or 3, got {stage}")
        return request, [], []  # nothing to merge (the planner resolves hundreds of such requests)
    explicit = {k for k, where in request.sources if where == "command line"}
    values, used, notes, files = _with_files(request.flat(), explicit, model_dtype)
    if values.get("stage") is not None and values.get("strategy") is not None:
        raise SettingsError("give --stage or --strategy, not both")
    if values.get("stage") is not None and values["stage"] not in STAGE_TO_STRATEGY:
        raise SettingsError(f"--stage must be 0, 1, 2 or 3, got {values['stage']}")
    sources = {**{k: "command line" for k in explicit}, **used}
    if values.get("pin_memory") is not None:  # DeepSpeed offload's pin_memory (and FSDP's: options.resolve)
        values["offload_pin_memory"] = values["pin_memory"]
        sources["offload_pin_memory"] = sources.get("pin_memory", "command line")
    path = values.get("deepspeed")
    if path:
        ds = dsconfig.load(path)
        if ds.unknown_keys:
            notes.append(f"{path}: ignored keys not modelled: {', '.join(ds.unknown_keys)}")
        notes.extend(f"{path}: {n}" for n in ds.notes)
        for name, theirs in ds.partial(hidden_size).items():
            if name == "stage":  # the file's ZeRO stage, unless the job's strategy is given
                mine = STAGE_TO_STRATEGY[values["stage"]] if values.get("stage") is not None else values.get("strategy")
                if mine is None:
                    values["stage"], sources["stage"] = theirs, path
                elif mine != STAGE_TO_STRATEGY.get(theirs):
                    where = sources.get("stage" if values.get("stage") is not None else "strategy", "command line")
                    notes.append(f"strategy: {where} {quote(mine)} overrides {path} "
                                 f"{quote(STAGE_TO_STRATEGY.get(theirs))}")
            elif values.get(name) is None:
                values[name], sources[name] = theirs, path
            elif values[name] != theirs:
                notes.append(f"{name}: {sources.get(name, 'command line')} {quote(values[name])} overrides {path} "
                             f"{quote(theirs)}")
    out = JobRequest.of(**values)
    return replace(out, adapters=request.adapters).with_sources(sources), notes, files
