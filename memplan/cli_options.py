"""The command line's options that several commands share (estimate, plan, validate), declared once, and the
framework knobs they collect. Imported by memplan/cli.py only (typer is imported here too)."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from memplan.errors import MemplanError

GpusPerNode = Annotated[Optional[int], typer.Option("--gpus-per-node", help="GPUs per node [default: min(gpus, 8)].")]
Stage = Annotated[Optional[int], typer.Option("--stage", help="DeepSpeed ZeRO stage 0-3 (shorthand for --strategy).")]
Strategy = Annotated[Optional[str], typer.Option("--strategy", help="single, ddp, zero0-3, zero-optimizer, "
                                                 "fsdp-full, fsdp-grad-op, fsdp-no-shard, hsdp [default: single on "
                                                 "one GPU, else ddp].")]
Recompute = Annotated[str, typer.Option("--recompute", help="none | selective | full | every:N (transformers' "
                                         "every_n_layers: blocks 0, N, 2N, ...) | layer-sac:N (torchtitan's: blocks "
                                         "N-1, 2N-1, ...).")]
MicroBatch = Annotated[Optional[int], typer.Option("--micro-batch", help="Micro-batch per GPU [default: 1].")]
SeqLen = Annotated[Optional[int], typer.Option("--seq-len", help="Sequence length [default: 2048].")]
GradAccum = Annotated[Optional[int], typer.Option("--grad-accum", help="Gradient accumulation steps [default: 1].")]
Precision = Annotated[Optional[str], typer.Option("--precision", help="deepspeed-bf16, deepspeed-fp16, torch-amp, "
                                                  "fsdp-bf16, pure-bf16, fp32 [default: the strategy's "
                                                  "framework's].")]
Task = Annotated[Optional[str], typer.Option("--task", help="The head to train, when the config's architectures is "
                                             "not it: causal-lm, masked-lm, sequence-classification, "
                                             "token-classification, question-answering (transformers' Auto class "
                                             "for the model type) [default: the config's architectures].")]
Optimizer = Annotated[Optional[str], typer.Option("--optimizer", help="adamw, adam, sgd, adafactor, adam8bit, "
                                                  "paged_adamw_8bit, paged_adamw_32bit, lion (lion-pytorch), "
                                                  "adamw-schedulefree (schedulefree), muon (torch.optim.Muon + "
                                                  "AdamW), adam-mini, apollo-adamw (APOLLO rank 128 on the "
                                                  "attention and MLP weights, AdamW on the rest).")]
OptimizerImpl = Annotated[Optional[str], typer.Option("--optimizer-impl", help="foreach, fused, single-tensor: "
                                                      "torch.optim's (under DeepSpeed, a client optimizer) "
                                                      "[default: DeepSpeed's own FusedAdam for DeepSpeed, foreach "
                                                      "for torch; cpu: single-tensor].")]
Attention = Annotated[str, typer.Option("--attention", help="sdpa (the device's own kernel choice) | flash (asked "
                                        "for: refused where the device cannot run it) | eager.")]
Gpu = Annotated[Optional[str], typer.Option("--gpu", help="GPU preset (memplan presets) for the fit verdict.")]
GpuMemory = Annotated[Optional[str], typer.Option("--gpu-memory", help="GPU memory, e.g. 80GB (10^9) or 80GiB "
                                                  "(2^30).")]
DeepSpeedConfig = Annotated[Optional[str], typer.Option("--deepspeed", help="The job's ds_config.json.")]
AllocatorConf = Annotated[Optional[str], typer.Option("--allocator-conf", help="The job's PYTORCH_CUDA_ALLOC_CONF, "
                                                      "e.g. expandable_segments:True [default: from the "
                                                      "environment].")]
Builder = Annotated[str, typer.Option("--builder", help="Inventory builder: auto | analytic | meta.")]
Activations = Annotated[str, typer.Option("--activations", help="auto (traced, analytic if the model cannot be "
                                          "traced) | traced | analytic.")]
CpuIsa = Annotated[Optional[str], typer.Option("--cpu-isa", help="device cpu: the instruction set the CPU kernels "
                                               "follow, avx2 | avx512 | avx512_bf16 | amx [default: this "
                                               "machine's].")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")]

# model parallelism (memplan/parallel/)
Tp = Annotated[Optional[int], typer.Option("--tp", help="Tensor-parallel degree [default: 1].")]
Pp = Annotated[Optional[int], typer.Option("--pp", help="Pipeline-parallel degree (stages) [default: 1].")]
Vpp = Annotated[Optional[int], typer.Option("--vpp", help="Pipeline stages per rank for a schedule that runs several "
                                            "(interleaved, looped-bfs, interleaved-zb) [default: 2].")]
Cp = Annotated[Optional[int], typer.Option("--cp", help="Context-parallel degree: each sequence split over cp ranks "
                                          "with ring attention (torchtitan) [default: 1].")]
Ep = Annotated[Optional[int], typer.Option("--ep", help="Expert-parallel degree: each MoE layer's routed experts split "
                                          "over ep of the data-parallel ranks (FSDP2) [default: 1].")]
Sp = Annotated[bool, typer.Option("--sp/--no-sp", help="Sequence parallelism with --tp.")]
LossParallel = Annotated[Optional[bool], typer.Option(
    "--loss-parallel/--no-loss-parallel", help="With --tp under FSDP/DDP: the loss on each rank's vocabulary rows "
    "(torchtitan's default), or on the gathered logits (transformers' own TP, Accelerate's tp_size) [default: on].")]
Schedule = Annotated[Optional[str], typer.Option("--schedule", help="Pipeline schedule, as torch.distributed.pipelining "
                                                 "runs it: 1f1b | gpipe | interleaved | looped-bfs | interleaved-zb | "
                                                 "zbv (zero-bubble) | dualpipev, or torch's class name "
                                                 "(Interleaved1F1B, ...) [default: 1f1b]; the micro-batches per step "
                                                 "are --grad-accum.")]


def parallel_of(values: dict[str, Any]) -> Any:
    """The model-parallel degrees the options give (memplan/parallel/degrees.py Parallel), None when none is given."""
    tp, pp, vpp, sp, schedule, ep, cp = (values.get(k) for k in ("tp", "pp", "vpp", "sp", "schedule", "ep", "cp"))
    lp = values.get("loss_parallel")
    if tp is None and pp is None and vpp is None and not sp and schedule is None and lp is None and ep is None \
            and cp is None:
        return None
    from memplan.errors import SettingsError
    from memplan.parallel import Parallel

    if sp and (tp is None or tp == 1):
        raise SettingsError("--sp needs --tp above 1: sequence parallelism splits the norms' and residuals' "
                            "activations over the tensor-parallel ranks")
    if schedule is not None:  # memplan's names or torch's (get_schedule_class: "Interleaved1F1B", "ZBVZeroBubble")
        from memplan.parallel.schedules import canonical

        schedule = canonical(schedule) or schedule
    return Parallel(tp=1 if tp is None else tp, pp=1 if pp is None else pp, ep=1 if ep is None else ep,
                    cp=1 if cp is None else cp,
                    vpp=vpp, sp=bool(sp),
                    schedule=schedule or "1f1b", loss_parallel=True if lp is None else bool(lp))

# DeepSpeed's knobs (DeepSpeedKnobs), as ds_config names them
ReduceBucketSize = Annotated[Optional[int], typer.Option(help="DeepSpeed reduce_bucket_size (elements).")]
AllgatherBucketSize = Annotated[Optional[int], typer.Option(help="DeepSpeed allgather_bucket_size (elements).")]
OverlapComm = Annotated[Optional[bool], typer.Option("--overlap-comm/--no-overlap-comm",
                                                     help="DeepSpeed overlap_comm.")]
ContiguousGradients = Annotated[Optional[bool], typer.Option("--contiguous-gradients/--no-contiguous-gradients")]
ReduceScatter = Annotated[Optional[bool], typer.Option(
    "--reduce-scatter/--no-reduce-scatter", help="DeepSpeed ZeRO-1/2 reduce_scatter: off, each gradient bucket is "
    "all-reduced in place [default: on].")]
GradAccumDtype = Annotated[Optional[str], typer.Option(
    help="DeepSpeed data_types.grad_accum_dtype: fp32 | bf16 | fp16 [default: the parameters' dtype]; with bf16, "
    "fp32 makes ZeRO stage 1 run BF16_Optimizer (refused); stage 0 takes only the parameters' dtype.")]
CommunicationDataType = Annotated[Optional[str], typer.Option(
    help="DeepSpeed communication_data_type: fp32 | bf16 | fp16, the dtype gradients are reduced in [default: the "
    "parameters' dtype].")]
MultiRankBucketAllreduce = Annotated[Optional[bool], typer.Option(
    "--multi-rank-bucket-allreduce/--no-multi-rank-bucket-allreduce", help="DeepSpeed ZeRO-1/2 "
    "use_multi_rank_bucket_allreduce: off, each bucket's slices are reduced to their owner rank (a reduce-scatter's "
    "volume, not an all-reduce's) [default: on].")]
PrefetchBucketSize = Annotated[Optional[int], typer.Option(help="stage3_prefetch_bucket_size (elements).")]
ParamPersistenceThreshold = Annotated[Optional[int], typer.Option(help="stage3_param_persistence_threshold.")]
MaxLiveParameters = Annotated[Optional[int], typer.Option(help="stage3_max_live_parameters (elements).")]
MaxReuseDistance = Annotated[Optional[int], typer.Option(help="stage3_max_reuse_distance (elements).")]
HpzPartitionSize = Annotated[Optional[int], typer.Option(help="ZeRO++ hpZ zero_hpz_partition_size.")]
Z3LeafModules = Annotated[Optional[str], typer.Option(
    "--z3-leaf-modules", help="ZeRO-3 leaf modules, fetched whole: class names (ClassName,...) or none "
    "[default: DeepSpeed's, the Mixtral/Qwen2-MoE/Qwen3-MoE sparse MoE blocks].")]
ZeroQuantizedWeights = Annotated[Optional[bool], typer.Option(
    "--zero-quantized-weights/--no-zero-quantized-weights", help="ZeRO++ qwZ: ZeRO-3 all-gathers int8 weights.")]
ZeroQuantizedGradients = Annotated[Optional[bool], typer.Option(
    "--zero-quantized-gradients/--no-zero-quantized-gradients",
    help="ZeRO++ qgZ: ZeRO-3 reduces gradients in int4 across nodes.")]
OffloadOptimizer = Annotated[Optional[bool], typer.Option("--offload-optimizer/--no-offload-optimizer",
                                                          help="DeepSpeed ZeRO-Offload of the optimizer.")]
OffloadParam = Annotated[Optional[bool], typer.Option("--offload-param/--no-offload-param",
                                                      help="DeepSpeed ZeRO-Offload of the parameters (stage 3).")]
# PyTorch's knobs (TorchKnobs)
ReshardAfterForward = Annotated[Optional[str], typer.Option(help="FSDP2: true, false, or a group size (int).")]
FsdpRootReshard = Annotated[Optional[str], typer.Option(
    help="FSDP2's root (the model, fully_shard-ed last): same (given the blocks' reshard_after_forward, as "
         "Accelerate passes it: resharded after forward and all-gathered again when backward begins) or auto "
         "(fully_shard(model) without it: kept unsharded from forward to backward) [default: same].")]
FsdpWrap = Annotated[Optional[str], typer.Option(help="FSDP units: block (each decoder block, then the root), "
                                                 "block+embeddings (FSDP2, torchtitan's: the input embedding, each "
                                                 "block, the final norm with the head), size:N (torch's "
                                                 "size_based_auto_wrap_policy, min_num_params N, e.g. size:1e8), "
                                                 "class:NAME[,NAME] (transformer_auto_wrap_policy over those module "
                                                 "classes) or "
                                                 "none (only the root; FSDP1: one FlatParameter) "
                                                 "[default: block].")]
HsdpShardSize = Annotated[Optional[int], typer.Option(help="HSDP shard group size [default: gpus per node].")]
FsdpVersion = Annotated[int, typer.Option(help="FSDP version: 2 (fully_shard) or 1 (FlatParameter).")]
BucketCapMb = Annotated[Optional[int], typer.Option(help="DDP bucket_cap_mb [default: 25].")]
GradientAsBucketView = Annotated[bool, typer.Option("--gradient-as-bucket-view",
                                                    help="DDP gradient_as_bucket_view.")]

Plot = Annotated[Optional[str], typer.Option("--plot", help="Draw stacked bars of per-GPU bytes by category to "
                                            "FILE.svg or FILE.png (estimate: across GPU counts; plan: across the "
                                            "candidates), the GPU's capacity as a line (needs matplotlib: "
                                            "pip install 'memplan[plot]').")]
HorovodFusionThreshold = Annotated[Optional[str], typer.Option("--horovod-fusion-threshold", help="Horovod's "
                                                               "HOROVOD_FUSION_THRESHOLD, e.g. 64MiB [default: "
                                                               "the environment's, else 128MiB].")]
HorovodCompression = Annotated[Optional[str], typer.Option("--horovod-compression", help="Horovod gradient "
                                                           "compression: none | fp16 [default: none].")]
TrainingArgs = Annotated[Optional[str], typer.Option("--training-args", help="The job's Hugging Face "
                                                    "TrainingArguments as JSON or YAML (batch size, accumulation, "
                                                    "bf16/fp16, checkpointing, optim, fsdp, deepspeed).")]
AccelerateConfig = Annotated[Optional[str], typer.Option("--accelerate-config", help="The job's `accelerate config` "
                                                         "YAML (processes, machines, mixed precision, FSDP or "
                                                         "DeepSpeed plugin).")]

LoraRank = Annotated[Optional[int], typer.Option("--lora-rank", help="LoRA fine-tuning (PEFT): rank-R adapters "
                                                 "train, the base weights are frozen.")]
LoraAlpha = Annotated[Optional[float], typer.Option("--lora-alpha", help="LoRA alpha (a scale: no effect on memory).")]
LoraTargets = Annotated[Optional[str], typer.Option("--lora-targets", help="LoRA target modules, q_proj,v_proj,... or "
                                                    "all-linear [default: PEFT's for the model type].")]
LoraDropout = Annotated[Optional[float], typer.Option("--lora-dropout", help="LoRA dropout (above 0 it keeps a mask "
                                                      "per adapted layer) [default: 0].")]
AdapterConfig = Annotated[Optional[str], typer.Option("--adapter-config", help="The job's PEFT adapter_config.json "
                                                      "(or its directory); --lora-* options override it.")]
QuantizeBase = Annotated[Optional[str], typer.Option("--quantize-base", help="QLoRA: the base's linear layers "
                                                     "stored 4-bit by bitsandbytes, nf4 or fp4 (needs --lora-rank "
                                                     "or --adapter-config).")]
DoubleQuant = Annotated[bool, typer.Option("--double-quant", help="QLoRA: bnb_4bit_use_double_quant (the 4-bit "
                                           "scales quantized to 8 bits too).")]
QuantComputeDtype = Annotated[Optional[str], typer.Option("--quant-compute-dtype", help="QLoRA: "
                                                          "bnb_4bit_compute_dtype, bfloat16, float16 or float32 "
                                                          "[default: bfloat16, as QLoRA recipes set it].")]
LORA = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "adapter_config", "quantize_base",
        "double_quant", "quant_compute_dtype")


def lora_spec(values: dict[str, Any], notes: list[str] | None = None) -> Any:
    """The job's LoRA adapter (memplan/model/lora.py LoraSpec) from --adapter-config and the --lora-* options,
    the options over the file; None for full fine-tuning."""
    from dataclasses import replace

    from memplan.errors import SettingsError
    from memplan.model import lora

    rank, alpha, targets, dropout = (values.get(k) for k in ("lora_rank", "lora_alpha", "lora_targets",
                                                              "lora_dropout"))
    path = values.get("adapter_config")
    if path is None and rank is None:
        given = [f"--{k.replace('_', '-')}" for k in ("lora_alpha", "lora_targets", "lora_dropout", "quantize_base",
                                                      "quant_compute_dtype")
                 if values.get(k) is not None] + (["--double-quant"] if values.get("double_quant") else [])
        if given:
            raise SettingsError(f"{', '.join(given)} without --lora-rank (or --adapter-config): give the rank")
        return None
    spec = lora.read_adapter_config(path) if path else lora.LoraSpec(rank=rank, alpha=alpha or rank)
    changes: dict[str, Any] = {}
    if rank is not None:
        changes["rank"] = rank
    if alpha is not None:
        changes["alpha"] = alpha
    if targets is not None:
        changes["targets"] = lora.parse_targets(targets)
    if dropout is not None:
        changes["dropout"] = dropout
    if values.get("quantize_base") is not None:
        changes["quantize"] = str(values["quantize_base"]).lower()
    if values.get("double_quant"):
        changes["double_quant"] = True
    if values.get("quant_compute_dtype") is not None:
        from memplan.units import normalize_dtype

        changes["compute_dtype"] = normalize_dtype(values["quant_compute_dtype"])
    quant = {"quantize", "double_quant", "compute_dtype"}
    if path and set(changes) - quant and notes is not None:
        notes.append(f"LoRA: the command line's {', '.join(sorted(set(changes) - quant))} override {path}")
    return replace(spec, **changes) if changes else spec


DS_KNOBS = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
            "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
            "hpz_partition_size", "offload_optimizer", "offload_param", "quantized_weights", "quantized_gradients",
            "reduce_scatter", "multi_rank_bucket_allreduce", "grad_accum_dtype", "communication_data_type")
TORCH_KNOBS = ("reshard_after_forward", "fsdp_wrap", "fsdp_root_reshard", "hsdp_shard_size", "fsdp_version", "cpu_offload", "bucket_cap_mb",
               "gradient_as_bucket_view")


def ds_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed knobs a command was given (its parameters by name)."""
    out = {k: values[k] for k in DS_KNOBS if k in values}
    if values.get("z3_leaf_modules") is not None:  # --z3-leaf-modules A,B | none
        raw = str(values["z3_leaf_modules"]).strip()
        out["leaf_classes"] = () if raw.lower() == "none" else tuple(x.strip() for x in raw.split(",") if x.strip())
        if raw.lower() != "none" and not out["leaf_classes"]:
            from memplan.errors import SettingsError

            raise SettingsError("--z3-leaf-modules is empty: give class names (ClassName,...) or none")
    return out


def torch_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """The PyTorch knobs a command was given, --reshard-after-forward read as FSDP2 reads it."""
    from memplan.options import parse_reshard

    out = {k: values[k] for k in TORCH_KNOBS if k in values}
    if "reshard_after_forward" in out:
        out["reshard_after_forward"] = parse_reshard(out["reshard_after_forward"])
    return out


def size_option(value: Optional[str], name: str, allow_zero: bool = False) -> Optional[int]:
    if value is None:
        return None
    from memplan.units import parse_size

    try:
        return parse_size(value, allow_zero)[0]
    except MemplanError as exc:
        raise MemplanError(f"{name}: {exc}") from None


def overheads(cuda_context: Optional[str], nccl: Optional[str], fragmentation_percent: Optional[int],
               cublas_workspace: Optional[str]) -> dict:
    return dict(cuda_context_bytes=size_option(cuda_context, "--cuda-context"),
                nccl_bytes_per_communicator=size_option(nccl, "--nccl-per-communicator"),
                fragmentation_percent=fragmentation_percent,
                blas_workspace_bytes=size_option(cublas_workspace, "--cublas-workspace", allow_zero=True))


def explicit(ctx: typer.Context) -> set[str]:
    """The parameters given on the command line (not defaults)."""
    out = set()
    for name in ctx.params:
        src = ctx.get_parameter_source(name)
        if src is not None and src.name == "COMMANDLINE":
            out.add(name)
    return out


def overheads_of(g: dict) -> dict:
    return overheads(g["cuda_context"], g["nccl_per_communicator"], g["fragmentation_percent"], g["cublas_workspace"])


def progress_for(as_json: bool) -> None:
    """Status lines on stderr for slow work (a trace, a long search): a terminal, no --json."""
    from memplan import progress

    progress.enable(progress.wanted(as_json))


def csv(value: str, name: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    if not items:
        raise MemplanError(f"{name} needs at least one value")
    return items


def horovod_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """Horovod's knobs a command was given (sizes read as the other size options)."""
    return {"fusion_threshold": size_option(values.get("horovod_fusion_threshold"), "--horovod-fusion-threshold",
                                            allow_zero=True),
            "compression": values.get("horovod_compression")}


# the memory beside the allocated peak, and the host's (estimate)
CpuOffload = Annotated[bool, typer.Option("--cpu-offload", help="FSDP CPUOffloadPolicy.")]
CudaContext = Annotated[Optional[str], typer.Option(help="CUDA context size [default: 512MiB].")]
NcclPerCommunicator = Annotated[Optional[str], typer.Option(help="NCCL buffers per communicator [default: 1GiB].")]
FragmentationPercent = Annotated[Optional[int], typer.Option(help="A flat allocator overhead, % of the allocated "
                                                             "peak, instead of the replayed reserved peak.")]
HostMemory = Annotated[Optional[str], typer.Option("--host-memory", help="A node's host RAM for offloaded states, "
                                                   "e.g. 1TiB: a host verdict too.")]
PinMemory = Annotated[Optional[bool], typer.Option("--pin-memory/--no-pin-memory", help="Offloaded states in pinned "
                                                   "memory (DeepSpeed offload pin_memory [default: false]; FSDP "
                                                   "CPUOffloadPolicy [default: true]).")]
CublasWorkspace = Annotated[Optional[str], typer.Option(help="cuBLAS workspace per handle, inside the peak (the job's "
                                                        "CUBLAS_WORKSPACE_CONFIG; 0 for :0:0) [default: the GPU's; "
                                                        "32MiB].")]


# ---- groups of options several commands take, added to a command's signature by @with_options ----
#: each group: (parameter name, its Annotated option type, its default), in the order --help lists them
OPTION_GROUPS: dict[str, tuple[tuple[str, Any, Any], ...]] = {
    "deepspeed": (
        ("reduce_bucket_size", ReduceBucketSize, None), ("allgather_bucket_size", AllgatherBucketSize, None),
        ("overlap_comm", OverlapComm, None), ("contiguous_gradients", ContiguousGradients, None),
        ("reduce_scatter", ReduceScatter, None), ("multi_rank_bucket_allreduce", MultiRankBucketAllreduce, None),
        ("grad_accum_dtype", GradAccumDtype, None), ("communication_data_type", CommunicationDataType, None),
        ("prefetch_bucket_size", PrefetchBucketSize, None),
        ("param_persistence_threshold", ParamPersistenceThreshold, None),
        ("max_live_parameters", MaxLiveParameters, None), ("max_reuse_distance", MaxReuseDistance, None),
        ("hpz_partition_size", HpzPartitionSize, None), ("quantized_weights", ZeroQuantizedWeights, None),
        ("quantized_gradients", ZeroQuantizedGradients, None), ("z3_leaf_modules", Z3LeafModules, None),
        ("offload_optimizer", OffloadOptimizer, None), ("offload_param", OffloadParam, None)),
    "torch": (
        ("reshard_after_forward", ReshardAfterForward, None), ("fsdp_wrap", FsdpWrap, None),
        ("fsdp_root_reshard", FsdpRootReshard, None), ("hsdp_shard_size", HsdpShardSize, None),
        ("fsdp_version", FsdpVersion, 2), ("bucket_cap_mb", BucketCapMb, None),
        ("gradient_as_bucket_view", GradientAsBucketView, False)),
    "parallel": (
        ("tp", Tp, None), ("pp", Pp, None), ("ep", Ep, None), ("cp", Cp, None), ("vpp", Vpp, None), ("sp", Sp, False),
        ("schedule", Schedule, None), ("loss_parallel", LossParallel, None)),
    "memory": (
        ("cpu_offload", CpuOffload, False), ("cuda_context", CudaContext, None),
        ("nccl_per_communicator", NcclPerCommunicator, None), ("fragmentation_percent", FragmentationPercent, None),
        ("allocator_conf", AllocatorConf, None), ("host_memory", HostMemory, None), ("pin_memory", PinMemory, None),
        ("cublas_workspace", CublasWorkspace, None)),
    "horovod": (("horovod_fusion_threshold", HorovodFusionThreshold, None),
                ("horovod_compression", HorovodCompression, None)),
    "adapters": (
        ("lora_rank", LoraRank, None), ("lora_alpha", LoraAlpha, None), ("lora_targets", LoraTargets, None),
        ("lora_dropout", LoraDropout, None), ("adapter_config", AdapterConfig, None),
        ("quantize_base", QuantizeBase, None), ("double_quant", DoubleQuant, False),
        ("quant_compute_dtype", QuantComputeDtype, None)),
}


def with_options(*groups: str) -> Any:
    """A command that takes the options of ``groups`` (OPTION_GROUPS) after its own, declared once: the command
    receives them in ``**options`` (typer reads the signature this sets)."""
    import inspect

    def add(fn: Any) -> Any:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        kw = inspect.Parameter.KEYWORD_ONLY
        extra = [inspect.Parameter(name, kw, default=default, annotation=kind)
                 for g in groups for name, kind, default in OPTION_GROUPS[g]]
        last = [p.replace(kind=kw) for p in own if p.name == "as_json"]  # --json stays last in --help
        fn.__signature__ = sig.replace(parameters=[p for p in own if p.name != "as_json"] + extra + last)
        return fn
    return add
