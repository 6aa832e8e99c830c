"""The job a user asks about, as one typed, frozen request: what the command line, the job's files and the
defaults say, before memplan derives anything from it (memplan/options.py resolves it into Settings).

A JobRequest is composed of parts (the model, the cluster, the batch, the training recipe, the model
parallelism, the adapters, each framework's knobs, the memory beside the peak, the job's files). Each field
carries its metadata (``Key``): its command-line flag and help, and its key in a DeepSpeed config, in Hugging
Face TrainingArguments and in an Accelerate config where those files set it. memplan/cli_options.py builds the
typer options of every command from that metadata; memplan/jobfiles.py reads the files into the same field
names, and its ``merged`` combines them in one place and records where each value came from. ``SearchSpace``
(what `memplan plan` searches) and ``HarnessRun`` (how `memplan validate` runs) are declared the same way.

Every field has a name of its own across the parts (its "flat" name, the command's parameter name), so a
change is ``request.changed(micro_batch=4, stage=3)`` (the 'to fit' suggestions and the planner's candidates).
Pure Python: no torch, no typer.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Iterator, Mapping

from memplan.errors import MemplanError, SettingsError


@dataclass(frozen=True)
class Key:
    """A request field's metadata: how a user gives it."""

    flag: str | None  #: the command-line option ("--micro-batch"; "--x/--no-x" for a switch); None: files only
    help: str = ""
    ds_config: str | None = None  #: its key in a DeepSpeed config (dotted), where that file sets it
    training_args: str | None = None  #: its key in Hugging Face TrainingArguments
    accelerate: str | None = None  #: its key in an `accelerate config` YAML
    #: the command line's text into the field's value (sizes, lists); None: typer's own conversion
    parse: Callable[[Any], Any] | None = None
    cli_type: Any = None  #: what typer reads when it differs from the field's type (a size's text)
    #: the value as the command line writes it, where the default rendering does not (--image-size's HxW)
    show: Callable[[Any], str] | None = None
    #: the jobs that read it (options.SCOPES: deepspeed, zero12, zero3, fsdp, fsdp2, hsdp, ddp, pp, tp, offload);
    #: given for another job it changes nothing, and the output says so. None: every job reads it
    scope: str | None = None


def opt(default: Any, flag: str | None, help: str = "", **meta: Any) -> Any:
    """A request field with its Key."""
    return field(default=default, metadata={"key": Key(flag, help, **meta)})


def _size(name: str, allow_zero: bool = False) -> Callable[[Any], int | None]:
    def parse(value: Any) -> int | None:
        if value is None:
            return None
        from memplan.units import parse_size

        try:
            return parse_size(str(value), allow_zero)[0]
        except MemplanError as exc:
            raise MemplanError(f"{name}: {exc}") from None
    return parse


def _image_size(value: Any) -> tuple[int, int] | None:
    """--image-size N | HxW (model/tasks.py parse_image_size)."""
    from memplan.model.tasks import parse_image_size

    return parse_image_size(value)


def _leaf_classes(value: Any) -> tuple[str, ...] | None:
    """--z3-leaf-modules A,B | none."""
    if value is None or isinstance(value, tuple):
        return value
    raw = str(value).strip()
    if raw.lower() == "none":
        return ()
    out = tuple(x.strip() for x in raw.split(",") if x.strip())
    if not out:
        raise SettingsError("--z3-leaf-modules is empty: give class names (ClassName,...) or none")
    return out


def _reshard(value: Any) -> bool | int | None:
    """--reshard-after-forward read as FSDP2 reads it: true, false, or an integer, a group size (1 keeps whole
    parameters, as false; the shard group's size reshards fully, as true: the accounting applies that, and the
    harness passes the integer to fully_shard)."""
    if value is None or isinstance(value, (bool, int)):
        return value
    from memplan.inputs import quote

    v = str(value).strip().lower()
    if v in ("true", "yes"):
        return True
    if v in ("false", "no"):
        return False
    try:
        n = int(v)
    except ValueError:
        raise SettingsError(f"--reshard-after-forward must be true, false or a group size, got {quote(value)}") from None
    if n < 1:
        raise SettingsError(f"--reshard-after-forward group size must be positive, got {n}")
    return n


MODEL_HELP = "Preset name, config.json, model directory, cached repo id, or pkg.mod:fn."


@dataclass(frozen=True)
class Model:
    """Which model, with which head, and how its inventory and activations are found."""

    model: str = opt("", None, MODEL_HELP)
    task: str | None = opt(None, "--task", "The head to train, when the config's architectures is not it: causal-lm, "
                           "masked-lm, sequence-classification, token-classification, question-answering, "
                           "seq2seq-lm, image-text-to-text (transformers' Auto class for the model type) [default: "
                           "the config's architectures].")
    builder: str = opt("auto", "--builder", "Inventory builder: auto | analytic | meta.")
    freeze: str | None = opt(None, "--freeze", "Parameters that do not train, comma-separated: vision (a "
                             "vision-language model's vision tower) or module paths (model.embed_tokens) "
                             "[default: none].")
    activations: str = opt("auto", "--activations", "auto (traced, analytic if the model cannot be traced) | traced "
                           "| analytic.")


@dataclass(frozen=True)
class Cluster:
    """Where the job runs."""

    gpus: int = opt(1, "--gpus", "Total GPUs (data-parallel ranks).", accelerate="num_processes")
    gpus_per_node: int | None = opt(None, "--gpus-per-node", "GPUs per node [default: min(gpus, 8)].",
                                    accelerate="num_processes / num_machines")
    gpu: str | None = opt(None, "--gpu", "GPU preset (memplan presets) for the fit verdict.")
    gpu_memory: str | None = opt(None, "--gpu-memory", "GPU memory, e.g. 80GB (10^9) or 80GiB (2^30).")
    device: str = opt("cuda", "--device", "cuda, or cpu (the gloo harness: no CUDA/NCCL overheads).")
    #: the GPU architecture the kernels are chosen for (sm80, sm90, ...) where no --gpu preset names it: the
    #: harness's and the benches' own (the CLI takes it from --gpu)
    gpu_arch: str | None = opt(None, None)
    cpu_isa: str | None = opt(None, "--cpu-isa", "device cpu: the instruction set the CPU kernels follow, avx2 | "
                              "avx512 | avx512_bf16 | amx [default: this machine's].")


@dataclass(frozen=True)
class Batch:
    """What each rank computes per micro-step, and how many micro-steps make a step."""

    micro_batch: int | None = opt(None, "--micro-batch", "Micro-batch per GPU [default: 1].",
                                  ds_config="train_micro_batch_size_per_gpu",
                                  training_args="per_device_train_batch_size")
    seq_len: int | None = opt(None, "--seq-len", "Sequence length [default: 2048] (an encoder-decoder's: its "
                              "encoder's).")
    target_len: int | None = opt(None, "--target-len", "An encoder-decoder's (T5, BART) decoder length: its labels "
                                 "per sample [default: --seq-len].")
    images: int | None = opt(None, "--images", "A vision-language model's images per sample, their tokens part of "
                             "--seq-len [default: 1].")
    image_size: tuple[int, int] | None = opt(None, "--image-size", "A vision-language model of any image resolution "
                                             "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL): each image's size as its processor "
                                             "resizes it, N or HxW pixels [default: the largest square its "
                                             "processor's default max_pixels lets through: 980 for Qwen2.5-VL].",
                                             parse=_image_size, cli_type=str,
                                             show=lambda v: f"{v[0]}x{v[1]}")
    grad_accum: int | None = opt(None, "--grad-accum", "Gradient accumulation steps [default: 1].",
                                 ds_config="gradient_accumulation_steps",
                                 training_args="gradient_accumulation_steps")


@dataclass(frozen=True)
class Training:
    """The data-parallel strategy, the precision recipe, the optimizer and the step's kernels."""

    stage: int | None = opt(None, "--stage", "DeepSpeed ZeRO stage 0-3 (shorthand for --strategy).",
                            ds_config="zero_optimization.stage", accelerate="deepspeed_config.zero_stage")
    strategy: str | None = opt(None, "--strategy", "single, ddp, zero0-3, zero-optimizer, fsdp-full, fsdp-grad-op, "
                               "fsdp-no-shard, hsdp [default: single on one GPU, else ddp].",
                               training_args="fsdp", accelerate="distributed_type")
    precision: str | None = opt(None, "--precision", "deepspeed-bf16, deepspeed-fp16, torch-amp, fsdp-bf16, "
                                "pure-bf16, bf16-autocast (a bf16 model under autocast: the HF Trainer's bf16 on a bf16 "
                                "checkpoint), fp32 [default: the strategy's framework's].",
                                ds_config="bf16.enabled / fp16.enabled", training_args="bf16 / fp16",
                                accelerate="mixed_precision")
    optimizer: str | None = opt(None, "--optimizer", "adamw, adam, sgd, adafactor, adam8bit, paged_adamw_8bit, "
                                "paged_adamw_32bit, lion (lion-pytorch), adamw-schedulefree (schedulefree), muon "
                                "(torch.optim.Muon + AdamW), muon-with-aux-adam (Keller Jordan's muon-optimizer: "
                                "MuonWithAuxAdam over DDP ranks, SingleDeviceMuonWithAuxAdam on one GPU), adam-mini, "
                                "apollo-adamw (APOLLO rank 128 on the "
                                "attention and MLP weights, AdamW on the rest), galore-adamw (GaLore, the same "
                                "weights, rank 128, SVD renewed every 200 steps).",
                                ds_config="optimizer.type", training_args="optim")
    optimizer_impl: str | None = opt(None, "--optimizer-impl", "foreach, fused, single-tensor: torch.optim's (under "
                                     "DeepSpeed, a client optimizer) [default: DeepSpeed's own FusedAdam for "
                                     "DeepSpeed, foreach for torch; cpu: single-tensor].", training_args="optim")
    recompute: str = opt("none", "--recompute", "none | selective | full | every:N (transformers' every_n_layers: "
                         "blocks 0, N, 2N, ...) | layer-sac:N (torchtitan's: blocks N-1, 2N-1, ...).",
                         training_args="gradient_checkpointing", accelerate="fsdp_config.fsdp_activation_checkpointing")
    attention: str = opt("sdpa", "--attention", "sdpa (the device's own kernel choice) | flash (asked for: refused "
                         "where the device cannot run it) | eager.")
    compile: str = opt("none", "--compile", "torch.compile with inductor: none | blocks (each transformer block "
                       "compiled: torchtitan's per-block compile; what each saves for backward is inductor's "
                       "partitioner's choice). The whole model in one graph is not modelled.")
    float8: str | None = opt(None, "--float8", "torchao float8 training (Float8Linear) on the job's bf16 recipe: "
                             "tensorwise | rowwise | rowwise-gw-hp [default: none; --precision fp8-RECIPE is the "
                             "same with torchtitan's recipe: fsdp-bf16 under FSDP2, torch-amp otherwise].",
                             accelerate="mixed_precision fp8 (fp8_config.backend AO)")
    float8_keep: str = opt("output", "--float8-keep", "the linears float8 training leaves in bf16: output "
                           "(torchtitan's converter: the output projection) | first-last (Accelerate's: the first "
                           "and the last nn.Linear); those with a dim not a multiple of 16 always.",
                           accelerate="mixed_precision fp8 (first-last)")
    float8_all_gather: bool = opt(False, "--float8-all-gather", "FSDP2 all-gathers the float8 linears' weights in "
                                  "float8 (torchao's enable_fsdp_float8_all_gather; tensorwise, fsdp-bf16).",
                                  accelerate="fp8_config.enable_fsdp_float8_all_gather")


@dataclass(frozen=True)
class ParallelDegrees:
    """Model parallelism as the user asks for it (memplan/parallel/degrees.py Parallel is what the engine builds)."""

    tp: int | None = opt(None, "--tp", "Tensor-parallel degree [default: 1].", accelerate="parallelism_config.tp_size")
    pp: int | None = opt(None, "--pp", "Pipeline-parallel degree (stages) [default: 1].")
    ep: int | None = opt(None, "--ep", "Expert-parallel degree: each MoE layer's routed experts split over ep of the "
                         "data-parallel ranks (FSDP2) [default: 1].")
    cp: int | None = opt(None, "--cp", "Context-parallel degree: each sequence split over cp ranks with ring "
                         "attention (torchtitan) [default: 1].", accelerate="parallelism_config.cp_size")
    vpp: int | None = opt(None, "--vpp", "Pipeline stages per rank for a schedule that runs several (interleaved, "
                          "looped-bfs, interleaved-zb) [default: 2].", scope="pp")
    sp: bool = opt(False, "--sp/--no-sp", "Sequence parallelism with --tp.")
    schedule: str | None = opt(None, "--schedule", "Pipeline schedule, as torch.distributed.pipelining runs it: 1f1b | "
                               "gpipe | interleaved | looped-bfs | interleaved-zb | zbv (zero-bubble) | dualpipev, "
                               "or torch's class name (Interleaved1F1B, ...) [default: 1f1b]; the micro-batches per "
                               "step are --grad-accum.", scope="pp")
    loss_parallel: bool | None = opt(None, "--loss-parallel/--no-loss-parallel", "With --tp under FSDP/DDP: the loss "
                                     "on each rank's vocabulary rows (torchtitan's default), or on the gathered "
                                     "logits (transformers' own TP, Accelerate's tp_size) [default: on].",
                                     accelerate="parallelism_config.tp_size", scope="tp")

    def build(self) -> Any:
        """The engine's Parallel (memplan/parallel/degrees.py), None when no degree is given."""
        tp, pp, vpp, sp, schedule, ep, cp, lp = (self.tp, self.pp, self.vpp, self.sp, self.schedule, self.ep, self.cp,
                                                 self.loss_parallel)
        if tp is None and pp is None and vpp is None and not sp and schedule is None and lp is None and ep is None \
                and cp is None:
            return None
        from memplan.parallel import Parallel

        if sp and (tp is None or tp == 1):
            raise SettingsError("--sp needs --tp above 1: sequence parallelism splits the norms' and residuals' "
                                "activations over the tensor-parallel ranks")
        if schedule is not None:  # memplan's names or torch's (get_schedule_class: "Interleaved1F1B", "ZBVZeroBubble")
            from memplan.parallel.schedules import canonical

            schedule = canonical(schedule) or schedule
        return Parallel(tp=1 if tp is None else tp, pp=1 if pp is None else pp, ep=1 if ep is None else ep,
                        cp=1 if cp is None else cp, vpp=vpp, sp=bool(sp), schedule=schedule or "1f1b",
                        loss_parallel=True if lp is None else bool(lp))


@dataclass(frozen=True)
class Adapters:
    """LoRA / QLoRA fine-tuning (PEFT): the flags, and the adapter they and --adapter-config describe."""

    lora_rank: int | None = opt(None, "--lora-rank", "LoRA fine-tuning (PEFT): rank-R adapters train, the base "
                                "weights are frozen.")
    lora_alpha: float | None = opt(None, "--lora-alpha", "LoRA alpha (a scale: no effect on memory).")
    lora_targets: str | None = opt(None, "--lora-targets", "LoRA target modules, q_proj,v_proj,... or all-linear "
                                   "[default: PEFT's for the model type].")
    lora_dropout: float | None = opt(None, "--lora-dropout", "LoRA dropout (above 0 it keeps a mask per adapted "
                                     "layer) [default: 0].")
    adapter_config: str | None = opt(None, "--adapter-config", "The job's PEFT adapter_config.json (or its "
                                     "directory); --lora-* options override it.")
    quantize_base: str | None = opt(None, "--quantize-base", "QLoRA: the base's linear layers stored 4-bit by "
                                    "bitsandbytes, nf4 or fp4 (needs --lora-rank or --adapter-config).")
    double_quant: bool = opt(False, "--double-quant", "QLoRA: bnb_4bit_use_double_quant (the 4-bit scales quantized "
                             "to 8 bits too).")
    quant_compute_dtype: str | None = opt(None, "--quant-compute-dtype", "QLoRA: bnb_4bit_compute_dtype, bfloat16, "
                                          "float16 or float32 [default: bfloat16, as QLoRA recipes set it].")
    quant_storage: str | None = opt(None, "--quant-storage", "QLoRA: bnb_4bit_quant_storage, the dtype the 4-bit "
                                    "codes are packed into: uint8, or bfloat16 / float32 for FSDP and ZeRO-3 to "
                                    "shard them (FSDP-QLoRA) [default: uint8].")
    #: the adapter as PEFT's LoraConfig (memplan/model/lora.py LoraSpec), made from the fields above and the
    #: adapter config when the request is made (``with_adapter``); None: full fine-tuning
    spec: Any = opt(None, None)

    def with_adapter(self, notes: list[str] | None = None) -> "Adapters":
        """These flags with the adapter they describe (``spec``), the flags over --adapter-config's file."""
        from memplan.model import lora

        rank, alpha, targets, dropout, path = (self.lora_rank, self.lora_alpha, self.lora_targets, self.lora_dropout,
                                               self.adapter_config)
        if path is None and rank is None:
            given = [f"--{k.replace('_', '-')}" for k in ("lora_alpha", "lora_targets", "lora_dropout",
                                                          "quantize_base", "quant_compute_dtype", "quant_storage")
                     if getattr(self, k) is not None] + (["--double-quant"] if self.double_quant else [])
            if given:
                raise SettingsError(f"{', '.join(given)} without --lora-rank (or --adapter-config): give the rank")
            return replace(self, spec=None)
        if path:
            spec = lora.read_adapter_config(path)
        else:
            assert rank is not None  # no adapter config: the rank was given (checked above)
            spec = lora.LoraSpec(rank=rank, alpha=alpha if alpha is not None else rank)
        changes: dict[str, Any] = {}
        if rank is not None:
            changes["rank"] = rank
        if alpha is not None:
            changes["alpha"] = alpha
        if targets is not None:
            changes["targets"] = lora.parse_targets(targets)
        if dropout is not None:
            changes["dropout"] = dropout
        if self.quantize_base is not None:
            changes["quantize"] = str(self.quantize_base).lower()
        if self.double_quant:
            changes["double_quant"] = True
        from memplan.units import normalize_dtype

        for flag, key in (("quant_compute_dtype", "compute_dtype"), ("quant_storage", "quant_storage")):
            value = getattr(self, flag)
            if value is not None:
                try:
                    changes[key] = normalize_dtype(value)
                except SettingsError:  # not a dtype at all: LoraSpec names the flag and its choices
                    changes[key] = str(value)
        quant = {"quantize", "double_quant", "compute_dtype", "quant_storage"}
        if path and set(changes) - quant and notes is not None:
            notes.append(f"LoRA: the command line's {', '.join(sorted(set(changes) - quant))} override {path}")
        return replace(self, spec=replace(spec, **changes) if changes else spec)


def _z(key: str) -> str:
    return f"zero_optimization.{key}"


@dataclass(frozen=True)
class DeepSpeed:
    """DeepSpeed's knobs (settings.py DeepSpeedKnobs), as its config names them; None: the config's, else
    DeepSpeed's default."""

    reduce_bucket_size: int | None = opt(None, "--reduce-bucket-size", "DeepSpeed reduce_bucket_size (elements).",
                                         ds_config=_z("reduce_bucket_size"), scope="deepspeed")
    allgather_bucket_size: int | None = opt(None, "--allgather-bucket-size", "DeepSpeed allgather_bucket_size "
                                            "(elements).", ds_config=_z("allgather_bucket_size"), scope="zero12")
    overlap_comm: bool | None = opt(None, "--overlap-comm/--no-overlap-comm", "DeepSpeed overlap_comm.",
                                    ds_config=_z("overlap_comm"), scope="deepspeed")
    contiguous_gradients: bool | None = opt(None, "--contiguous-gradients/--no-contiguous-gradients",
                                            ds_config=_z("contiguous_gradients"), scope="deepspeed")
    reduce_scatter: bool | None = opt(None, "--reduce-scatter/--no-reduce-scatter", "DeepSpeed ZeRO-1/2 "
                                      "reduce_scatter: off, each gradient bucket is all-reduced in place [default: "
                                      "on].", ds_config=_z("reduce_scatter"), scope="zero12")
    multi_rank_bucket_allreduce: bool | None = opt(
        None, "--multi-rank-bucket-allreduce/--no-multi-rank-bucket-allreduce", "DeepSpeed ZeRO-1/2 "
        "use_multi_rank_bucket_allreduce: off, each bucket's slices are reduced to their owner rank (a "
        "reduce-scatter's volume, not an all-reduce's) [default: on].", ds_config=_z("use_multi_rank_bucket_allreduce"), scope="zero12")
    grad_accum_dtype: str | None = opt(None, "--grad-accum-dtype", "DeepSpeed data_types.grad_accum_dtype: fp32 | "
                                       "bf16 | fp16 [default: the parameters' dtype]; with bf16, fp32 makes ZeRO "
                                       "stage 1 run BF16_Optimizer (refused); stage 0 takes only the parameters' "
                                       "dtype.", ds_config="data_types.grad_accum_dtype", scope="deepspeed")
    communication_data_type: str | None = opt(None, "--communication-data-type", "DeepSpeed communication_data_type: "
                                              "fp32 | bf16 | fp16, the dtype gradients are reduced in [default: the "
                                              "parameters' dtype].", ds_config="communication_data_type", scope="deepspeed")
    prefetch_bucket_size: int | None = opt(None, "--prefetch-bucket-size", "stage3_prefetch_bucket_size (elements).",
                                           ds_config=_z("stage3_prefetch_bucket_size"), scope="zero3")
    param_persistence_threshold: int | None = opt(None, "--param-persistence-threshold",
                                                  "stage3_param_persistence_threshold.",
                                                  ds_config=_z("stage3_param_persistence_threshold"), scope="zero3")
    max_live_parameters: int | None = opt(None, "--max-live-parameters", "stage3_max_live_parameters (elements).",
                                          ds_config=_z("stage3_max_live_parameters"), scope="zero3")
    max_reuse_distance: int | None = opt(None, "--max-reuse-distance", "stage3_max_reuse_distance (elements).",
                                         ds_config=_z("stage3_max_reuse_distance"), scope="zero3")
    hpz_partition_size: int | None = opt(None, "--hpz-partition-size", "ZeRO++ hpZ zero_hpz_partition_size.",
                                         ds_config=_z("zero_hpz_partition_size"), scope="zero3")
    quantized_weights: bool | None = opt(None, "--zero-quantized-weights/--no-zero-quantized-weights", "ZeRO++ qwZ: "
                                         "ZeRO-3 all-gathers int8 weights.", ds_config=_z("zero_quantized_weights"), scope="zero3")
    quantized_gradients: bool | None = opt(None, "--zero-quantized-gradients/--no-zero-quantized-gradients",
                                           "ZeRO++ qgZ: ZeRO-3 reduces gradients in int4 across nodes.",
                                           ds_config=_z("zero_quantized_gradients"), scope="zero3")
    leaf_classes: tuple[str, ...] | None = opt(
        None, "--z3-leaf-modules", "ZeRO-3 leaf modules, fetched whole: class names (ClassName,...) or none "
        "[default: DeepSpeed's, the Mixtral/Qwen2-MoE/Qwen3-MoE sparse MoE blocks].",
        ds_config=_z("leaf_module.classes"), parse=_leaf_classes, cli_type=str, scope="zero3")
    offload_optimizer: bool | None = opt(None, "--offload-optimizer/--no-offload-optimizer", "DeepSpeed ZeRO-Offload "
                                         "of the optimizer.", ds_config=_z("offload_optimizer.device"),
                                         accelerate="deepspeed_config.offload_optimizer_device")
    offload_param: bool | None = opt(None, "--offload-param/--no-offload-param", "DeepSpeed ZeRO-Offload of the "
                                     "parameters (stage 3).", ds_config=_z("offload_param.device"),
                                     accelerate="deepspeed_config.offload_param_device")
    # the config's keys with no command-line option (the harness and the benches set them too)
    sub_group_size: int | None = opt(None, None, ds_config=_z("sub_group_size"))
    leaf_names: tuple[str, ...] | None = opt(None, None, ds_config=_z("leaf_module.names"))
    leaf_name_suffixes: tuple[str, ...] | None = opt(None, None, ds_config=_z("leaf_module.name_suffixes"))
    module_granularity_threshold: int | None = opt(None, None, ds_config=_z("stage3_module_granularity_threshold"))
    offload_pin_memory: bool | None = opt(None, None, ds_config=_z("offload_optimizer.pin_memory"))
    memory_efficient_linear: bool | None = opt(None, None, ds_config=_z("memory_efficient_linear"))


FSDP_WRAP_HELP = ("FSDP units: block (each decoder block, then the root), block+embeddings (FSDP2, torchtitan's: the "
                  "input embedding, each block, the final norm with the head), size:N (torch's "
                  "size_based_auto_wrap_policy, min_num_params N, e.g. size:1e8), class:NAME[,NAME] "
                  "(transformer_auto_wrap_policy over those module classes) or none (only the root; FSDP1: one "
                  "FlatParameter) [default: block].")


@dataclass(frozen=True)
class Torch:
    """PyTorch's FSDP and DDP knobs (settings.py TorchKnobs)."""

    reshard_after_forward: bool | int | None = opt(None, "--reshard-after-forward", "FSDP2: true, false, or a group "
                                                   "size (int).", training_args="fsdp_config.reshard_after_forward",
                                                   accelerate="fsdp_config.fsdp_reshard_after_forward",
                                                   parse=_reshard, cli_type=str, scope="fsdp")
    fsdp_wrap: str | None = opt(None, "--fsdp-wrap", FSDP_WRAP_HELP, training_args="fsdp_config.auto_wrap_policy",
                                accelerate="fsdp_config.fsdp_auto_wrap_policy")
    fsdp_root_reshard: str | None = opt(None, "--fsdp-root-reshard", "FSDP2's root (the model, fully_shard-ed last): "
                                        "same (given the blocks' reshard_after_forward, as Accelerate passes it: "
                                        "resharded after forward and all-gathered again when backward begins) or "
                                        "auto (fully_shard(model) without it: kept unsharded from forward to "
                                        "backward) [default: same].", scope="fsdp2")
    hsdp_shard_size: int | None = opt(None, "--hsdp-shard-size", "HSDP shard group size [default: gpus per node].",
                                      accelerate="parallelism_config.dp_shard_size", scope="hsdp")
    fsdp_version: int = opt(2, "--fsdp-version", "FSDP version: 2 (fully_shard) or 1 (FlatParameter).",
                            training_args="fsdp_config.version", accelerate="fsdp_config.fsdp_version", scope="fsdp")
    bucket_cap_mb: int | None = opt(None, "--bucket-cap-mb", "DDP bucket_cap_mb [default: 25].",
                                    training_args="ddp_bucket_cap_mb", scope="ddp")
    gradient_as_bucket_view: bool = opt(False, "--gradient-as-bucket-view", "DDP gradient_as_bucket_view.", scope="ddp")
    cpu_offload: bool = opt(False, "--cpu-offload", "FSDP CPUOffloadPolicy.", training_args="fsdp offload",
                            accelerate="fsdp_config.fsdp_offload_params")


@dataclass(frozen=True)
class Horovod:
    """Horovod's knobs (settings.py HorovodKnobs)."""

    horovod_fusion_threshold: int | None = opt(None, "--horovod-fusion-threshold", "Horovod's "
                                               "HOROVOD_FUSION_THRESHOLD, e.g. 64MiB [default: the environment's, "
                                               "else 128MiB].", parse=_size("--horovod-fusion-threshold", True),
                                               cli_type=str)
    horovod_compression: str | None = opt(None, "--horovod-compression", "Horovod gradient compression: none | fp16 "
                                          "[default: none].")


@dataclass(frozen=True)
class Memory:
    """The memory beside the allocated peak (settings.py Overheads, the allocator's configuration) and the host's."""

    cuda_context_bytes: int | None = opt(None, "--cuda-context", "CUDA context size [default: 512MiB].",
                                         parse=_size("--cuda-context"), cli_type=str)
    nccl_bytes_per_communicator: int | None = opt(None, "--nccl-per-communicator", "NCCL buffers per communicator "
                                                  "[default: 1GiB].", parse=_size("--nccl-per-communicator"),
                                                  cli_type=str)
    fragmentation_percent: int | None = opt(None, "--fragmentation-percent", "A flat allocator overhead, % of the "
                                            "allocated peak, instead of the replayed reserved peak.")
    allocator_conf: str | None = opt(None, "--allocator-conf", "The job's PYTORCH_CUDA_ALLOC_CONF, e.g. "
                                     "expandable_segments:True [default: from the environment].")
    host_memory: str | None = opt(None, "--host-memory", "A node's host RAM for offloaded states, e.g. 1TiB: a host "
                                  "verdict too.")
    pin_memory: bool | None = opt(None, "--pin-memory/--no-pin-memory", "Offloaded states in pinned memory "
                                  "(DeepSpeed offload pin_memory [default: false]; FSDP CPUOffloadPolicy [default: "
                                  "true]).", scope="offload")
    blas_workspace_bytes: int | None = opt(None, "--cublas-workspace", "cuBLAS workspace per handle, inside the peak "
                                           "(the job's CUBLAS_WORKSPACE_CONFIG; 0 for :0:0) [default: the GPU's; "
                                           "32MiB].", parse=_size("--cublas-workspace", True), cli_type=str)


@dataclass(frozen=True)
class Files:
    """The job's own files (memplan/jobfiles.py, memplan/dsconfig.py), whose settings fill what the command line
    does not give."""

    deepspeed: str | None = opt(None, "--deepspeed", "The job's ds_config.json.", training_args="deepspeed",
                                accelerate="deepspeed_config.deepspeed_config_file")
    training_args: str | None = opt(None, "--training-args", "The job's Hugging Face TrainingArguments as JSON or "
                                    "YAML (batch size, accumulation, bf16/fp16, checkpointing, optim, fsdp, "
                                    "deepspeed).")
    accelerate_config: str | None = opt(None, "--accelerate-config", "The job's `accelerate config` YAML (processes, "
                                        "machines, mixed precision, FSDP or DeepSpeed plugin).")


#: the parts of a request, by name: a command takes the options of the parts it names (cli_options.request_options)
PARTS: dict[str, type] = {"model": Model, "cluster": Cluster, "batch": Batch, "training": Training,
                          "parallel": ParallelDegrees, "adapters": Adapters, "deepspeed": DeepSpeed, "torch": Torch,
                          "horovod": Horovod, "memory": Memory, "files": Files}


def keys(part: type) -> Iterator[tuple[str, Any, Key]]:
    """A part's fields: (name, default, Key), in declaration order."""
    for f in fields(part):
        default = f.default if f.default is not MISSING else None
        yield f.name, default, f.metadata["key"]


#: each flat name's part
_PART_OF: dict[str, str] = {name: part for part, cls in PARTS.items() for name, _, _ in keys(cls)}


@dataclass(frozen=True)
class JobRequest:
    """One training job as asked: every part's values, and where each came from (``sources``: flat name ->
    "command line", a file's path; a name absent is the default)."""

    model: Model = Model()
    cluster: Cluster = Cluster()
    batch: Batch = Batch()
    training: Training = Training()
    parallel: ParallelDegrees = ParallelDegrees()
    adapters: Adapters = Adapters()
    deepspeed: DeepSpeed = DeepSpeed()
    torch: Torch = Torch()
    horovod: Horovod = Horovod()
    memory: Memory = Memory()
    files: Files = Files()
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @classmethod
    def of(cls, **values: Any) -> "JobRequest":
        """A request from flat names (``micro_batch=4``), each counted as given (the job's files do not override
        it); ``lora`` (a LoraSpec) is the adapter itself, ``parallel`` (a memplan.parallel.Parallel) its degrees.
        Values are taken as typed (sizes in bytes)."""
        values = dict(values)
        spec = values.pop("lora", None)
        par = values.pop("parallel", None)
        if par is not None:
            for k in ("tp", "pp", "ep", "cp", "vpp", "sp", "schedule", "loss_parallel"):
                values.setdefault(k, getattr(par, k))
        out = cls().changed(**values)
        if spec is not None:
            out = replace(out, adapters=replace(out.adapters, spec=spec))
        return out

    def changed(self, **values: Any) -> "JobRequest":
        """This request with the flat names ``values`` set and counted as given (the other fields as they are)."""
        by_part: dict[str, dict[str, Any]] = {}
        for k, v in values.items():
            if k not in _PART_OF:
                raise TypeError(f"JobRequest has no field {k!r}")
            by_part.setdefault(_PART_OF[k], {})[k] = v
        out = replace(self, **{p: replace(getattr(self, p), **ch) for p, ch in by_part.items()})
        return out.with_sources({**dict(self.sources), **{k: "command line" for k in values}})

    @staticmethod
    def part_of(name: str) -> str:
        """The part (``adapters``, ``training``, ...) a flat field name belongs to."""
        return _PART_OF[name]

    def flat(self) -> dict[str, Any]:
        """Every field by its flat name."""
        return {name: getattr(getattr(self, part), name) for name, part in _PART_OF.items()}

    def __getitem__(self, name: str) -> Any:
        return getattr(getattr(self, _PART_OF[name]), name)

    def flags(self, names: Iterable[str] | None = None) -> list[str]:
        """The command-line options that give the fields ``names`` (all) the values they have here, where those
        differ from the defaults: the options a printed command carries."""
        import shlex

        wanted = None if names is None else set(names)
        out: list[str] = []
        for part, cls in PARTS.items():
            for name, default, key in keys(cls):
                value = getattr(getattr(self, part), name)
                if key.flag is None or value == default or (wanted is not None and name not in wanted):
                    continue
                on, _, off = key.flag.partition("/")
                if isinstance(value, bool) and key.cli_type is None:  # a typer flag (--x) or switch (--x/--no-x)
                    if value or off:
                        out.append(on if value else off)
                    continue
                text = key.show(value) if key.show is not None else \
                    ("none" if not value else ",".join(value)) if isinstance(value, tuple) else \
                    str(value).lower() if isinstance(value, bool) else str(value)
                out.append(f"{on} {shlex.quote(text)}")
        return out

    def source(self, name: str) -> str | None:
        """Where ``name``'s value came from: "command line", a file's path, or None (memplan's default)."""
        return dict(self.sources).get(name)

    def with_sources(self, sources: Mapping[str, str]) -> "JobRequest":
        """This request with ``sources`` (flat name -> "command line" or a file's path) as where its values came
        from."""
        return replace(self, sources=tuple(sources.items()))


def csv(name: str) -> Callable[[Any], tuple[str, ...]]:
    """A comma-separated list option (--strategies a,b), at least one value."""
    def parse(value: Any) -> tuple[str, ...]:
        if isinstance(value, tuple):
            return value
        items = tuple(v.strip() for v in str(value).split(",") if v.strip())
        if not items:
            raise MemplanError(f"{name} needs at least one value")
        return items
    return parse


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """A dataclass whose fields carry a Key (SearchSpace, HarnessRun) from a command's values,
    each parsed as its Key says; a field not given keeps its default."""
    out = {}
    for name, _, key in keys(cls):
        if name in values:
            v = values[name]
            out[name] = key.parse(v) if key.parse is not None and v is not None else v
    return cls(**out)


#: the strategies `memplan plan` considers unless told (memplan/planner.py)
DEFAULT_STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "zero-optimizer", "fsdp-full", "fsdp-grad-op", "hsdp")


@dataclass(frozen=True)
class SearchSpace:
    """What `memplan plan` searches over (its own options, with their flags); the rest of the job is the base
    request."""

    max_gpus: int = opt(1024, "--max-gpus", "Largest GPU count to consider.")
    strategies: tuple[str, ...] = opt(DEFAULT_STRATEGIES, "--strategies", "Comma-separated strategies to consider.",
                                      parse=csv("--strategies"), cli_type=str)
    recomputes: tuple[str, ...] = opt(("none", "full"), "--recompute", "Comma-separated: none, selective, full, "
                                      "every:N, layer-sac:N.", parse=csv("--recompute"), cli_type=str)
    micro_batch: int | None = opt(None, "--micro-batch", "Fix the micro-batch (else the largest that fits, up to "
                                  "--max-micro-batch).")
    max_micro_batch: int = opt(64, "--max-micro-batch", "Largest micro-batch to consider.")
    allow_offload: bool = opt(False, "--allow-offload", "Also consider DeepSpeed ZeRO-Offload (optimizer, or "
                              "optimizer and parameters, on the host).")
    min_headroom: str | None = opt(None, "--min-headroom", "What every candidate must leave free: a size (8GiB, 8GB) "
                                   "or a fraction of the GPU (0.1 or 10%) [default: 0].")
    layouts: bool = opt(False, "--layouts", "Also consider tensor parallelism within a node and pipeline stages "
                        "across nodes (fsdp-full, ddp, zero1).")


@dataclass(frozen=True)
class HarnessRun:
    """How `memplan validate` runs the job in the harness (its own options, with their flags)."""

    layers: int | None = opt(None, "--layers", "Scale the model down to this many blocks.")
    hidden: int | None = opt(None, "--hidden", "Scale the hidden size down (head_dim kept).")
    vocab: int | None = opt(None, "--vocab", "Scale the vocabulary down.")
    warmup_steps: int = opt(2, "--warmup-steps", "Steps before measuring (states get allocated).")
    steps: int = opt(1, "--steps", "Measured steps.")
    timeout: float = opt(600.0, "--timeout", "Seconds before a hung run is stopped.")
    tolerance: float = opt(0.03, "--tolerance", "Allowed |relative error| on the peak.")


def from_command(values: Mapping[str, Any], explicit: Iterable[str] = ()) -> JobRequest:
    """A request from a command's parameters (typer's values: a size as its text), each parsed as its Key says;
    ``explicit``: those given on the command line (the others are the command's defaults, which the job's files
    override)."""
    out: dict[str, Any] = {}
    for part in PARTS.values():
        for name, _, key in keys(part):
            if name in values:
                v = values[name]
                out[name] = key.parse(v) if key.parse is not None and v is not None else v
    given = set(explicit)
    return JobRequest.of(**out).with_sources({k: "command line" for k in out if k in given})
