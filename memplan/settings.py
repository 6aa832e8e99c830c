"""The settings of one training job, as the engine reads them: the strategy row, the precision recipe, the
optimizer, the cluster, the framework knobs (DeepSpeed's and PyTorch's, with their own defaults) and the
overheads outside the allocator. Plain frozen data with the checks every caller needs; no arithmetic beyond
the shard group and the defaults that follow from the settings alone.

Every module that needs a configuration type imports it from here (the engine, the harness, the planner),
so none of them imports the engine for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from memplan.errors import SettingsError
from memplan.inputs import quote
from memplan.precision import OPTIMIZER_IMPLS, Optimizer, Recipe
from memplan.strategies import Strategy
from memplan.units import GiB, MiB


@dataclass(frozen=True, kw_only=True)
class DeepSpeedKnobs:
    """DeepSpeed ZeRO knobs with DeepSpeed's own defaults (deepspeed/runtime/zero/config.py, 0.19)."""

    reduce_bucket_size: int = 500_000_000  #: elements; ipg bucket(s) of this many grads
    allgather_bucket_size: int = 500_000_000  #: elements; ZeRO-1/2 all-gather chunking (in place here)
    overlap_comm: bool | None = None  #: None -> DeepSpeed's default: True for stage 3, False otherwise
    contiguous_gradients: bool = True
    prefetch_bucket_size: int = 50_000_000  #: stage3_prefetch_bucket_size, elements
    param_persistence_threshold: int = 100_000  #: stage3_param_persistence_threshold, elements
    max_live_parameters: int = 1_000_000_000  #: stage3_max_live_parameters, elements
    max_reuse_distance: int = 1_000_000_000  #: stage3_max_reuse_distance, elements
    sub_group_size: int = 1_000_000_000
    hpz_partition_size: int = 1  #: zero_hpz_partition_size (ZeRO++ secondary partition within a node)
    #: ZeRO++ qwZ (zero_quantized_weights): ZeRO-3 all-gathers int8 weights with fp32 group scales
    quantized_weights: bool = False
    #: ZeRO++ qgZ (zero_quantized_gradients): int4 all-to-all gradient reduce, across nodes only
    quantized_gradients: bool = False
    #: ZeRO-3 leaf modules (zero_optimization.leaf_module; memplan/model/z3_leaf.py): classes (None: DeepSpeed's
    #: defaults, the Mixtral/Qwen2-MoE/Qwen3-MoE sparse MoE blocks), module names, name suffixes
    leaf_classes: tuple[str, ...] | None = None
    leaf_names: tuple[str, ...] = ()
    leaf_name_suffixes: tuple[str, ...] = ()
    #: stage3_module_granularity_threshold: modules with at most this many parameters per layer become leaves
    module_granularity_threshold: int = 0
    offload_optimizer: bool = False  #: offload_optimizer.device == "cpu"
    offload_param: bool = False  #: offload_param.device == "cpu" (stage 3 only)
    #: offload_optimizer / offload_param .pin_memory (DeepSpeed's default: false): pinned host buffers, which
    #: PyTorch's pinned allocator rounds up to a power of two (memplan/host.py)
    offload_pin_memory: bool = False
    #: ZeRO-1/2's reduce path (stage_1_and_2.py average_tensor): reduce_scatter false all-reduces each bucket in
    #: place; with it (the default) the bucket's slices are all-reduced through a flattened copy
    #: (use_multi_rank_bucket_allreduce, the default) or reduced to each slice's owner rank (false)
    reduce_scatter: bool = True
    multi_rank_bucket_allreduce: bool = True
    #: data_types.grad_accum_dtype (fp32 | bf16 | fp16; None: the parameters' dtype, DeepSpeed's default): with
    #: bf16, fp32 makes ZeRO stage 1 run BF16_Optimizer, and stage 0 takes only the parameters' own dtype
    #: (engine.py _do_optimizer_sanity_check)
    grad_accum_dtype: str | None = None
    #: communication_data_type (fp32 | bf16 | fp16; None: the parameters' dtype, DeepSpeed's default): the dtype the
    #: gradients are reduced in, a cast copy of each reduced bucket where it differs (stage_1_and_2.py
    #: allreduce_bucket, stage3.py __avg_scatter_grads)
    communication_data_type: str | None = None
    #: stage 3 replaces torch.nn.functional.linear with LinearFunctionForZeroStage3 (changes the traced
    #: activations on CPU and under autocast: memplan/activations/tracing_keys.py trace_linear)
    memory_efficient_linear: bool = True


@dataclass(frozen=True, kw_only=True)
class TorchKnobs:
    bucket_cap_mb: int = 25  #: DDP default (torch/nn/parallel/distributed.py)
    #: bucket_cap_mb left at DDP's default (None): the rebuilt Reducer's first bucket is then 1 MiB
    #: (_BucketCapacityConfig.create: dist._DEFAULT_FIRST_BUCKET_BYTES only while the cap is the default; a cap
    #: given, even 25, makes the first bucket as large as the others)
    bucket_cap_default: bool = True
    gradient_as_bucket_view: bool = False  #: DDP default
    reshard_after_forward: bool | int | None = None  #: FSDP2; None -> the strategy's default
    hsdp_shard_size: int | None = None  #: HSDP shard group size; None -> gpus per node
    fsdp_version: int = 2
    cpu_offload: bool = False  #: FSDP CPUOffloadPolicy: sharded params, grads and states on the host
    cpu_offload_pin_memory: bool = True  #: CPUOffloadPolicy(pin_memory=True), its default
    #: FSDP2 units: "block" (each decoder block fully_shard-ed, then the root: Accelerate's transformer-based wrap,
    #: torchtitan's blocks) or "none" (only the root: the whole model one group)
    fsdp_wrap: str = "block"
    #: FSDP2's root: "same" (fully_shard(model, reshard_after_forward=<the blocks' value>), as Accelerate's
    #: fsdp2_prepare_model calls it: resharded after forward when the blocks are) or "auto" (fully_shard(model)
    #: without the argument: _lazy_init keeps the root unsharded after forward)
    fsdp_root_reshard: str = "same"
    #: the module paths of a class wrap (fsdp_wrap "class:A,B"), resolved with the model by options.py
    fsdp_wrap_modules: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class HorovodKnobs:
    #: HOROVOD_FUSION_THRESHOLD: the fusion buffer's bytes, allocated at the first fused all-reduce and kept
    #: (horovod/common/operations.cc: 128 MiB unless the variable sets it)
    fusion_threshold: int = 128 * MiB
    #: hvd.DistributedOptimizer(compression=...): "none", or "fp16" (an fp16 copy of every gradient from its hook
    #: to the step: horovod/torch/compression.py FP16Compressor, optimizer.py synchronize)
    compression: str = "none"


@dataclass(frozen=True, kw_only=True)
class Overheads:
    """Terms outside the allocator's count, added for the fit verdict only (device cuda)."""

    #: CUDA context + kernels loaded lazily: typically 0.3-0.6 GiB on A100/H100 with CUDA 12 lazy loading.
    cuda_context_bytes: int = 512 * MiB
    #: NCCL buffers per communicator: 0.5-1.6 GB observed on A100/H100 (NCCL issues #864, #964).
    nccl_bytes_per_communicator: int = 1 * GiB
    #: Caching-allocator overhead (reserved - allocated) as a flat fraction of the allocated peak: the user's own
    #: figure. None: the reserved peak is replayed (memplan/reserved.py), or, where it cannot be, only bounded
    #: from below by the allocated peak (Plan.reserved_bound: no figure is guessed).
    fragmentation_percent: int | None = None


#: threads that run GEMMs in a training step, each with its own cuBLAS handle and workspace (Cluster)
BLAS_HANDLES = 2


def default_blas_workspace(arch: str) -> int:
    """PyTorch's cuBLAS / hipBLAS workspace per handle without CUBLAS_WORKSPACE_CONFIG, for an architecture
    ("sm90", "gfx942", ...): aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize. The GPU presets
    carry these values (tested), and validate applies it to the GPU it runs on."""
    if arch.startswith("gfx"):
        return (128 if arch.startswith(("gfx94", "gfx95")) else 32) * MiB
    return 32 * MiB if arch == "sm90" else 4096 * 1024 * 2 + 16 * 1024 * 8


#: the largest values memplan sizes: past them no cluster or job exists, and arithmetic on them means nothing
#: (the planner searches within the same bounds)
MAX_GPUS = 1 << 20
MAX_GPUS_PER_NODE = 1 << 10
MAX_MICRO_BATCH = 1 << 20
MAX_SEQ_LEN = 1 << 26
MAX_GRAD_ACCUM = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Cluster:
    gpus: int = 1
    gpus_per_node: int = 8
    gpu_memory_bytes: int | None = None
    device: str = "cuda"  #: cuda | cpu (the gloo harness: no CUDA context, NCCL or allocator rounding)
    #: cuBLAS workspace per handle, allocated from the caching allocator (so inside the allocated peak) the first
    #: time a handle runs a GEMM on a stream, and kept: at::cuda::getCurrentCUDABlasHandle ->
    #: getNewWorkspace() -> CUDACachingAllocator::allocate(getChosenWorkspaceSize()) in
    #: aten/src/ATen/cuda/CublasHandlePool.cpp; CUBLAS_WORKSPACE_CONFIG, else ":4096:8" (32 MiB) on sm90 and
    #: ":4096:2:16:8" (8 MiB + 128 KiB) on other NVIDIA GPUs; hipBLAS 32 MiB, 128 MiB on gfx94x/gfx95x.
    #: The GPU presets carry their value; without one, the largest CUDA default.
    blas_workspace_bytes: int = 32 * MiB
    #: the GPU's architecture (smXY, gfxNNN): which SDPA kernels the traced step takes (memplan/activations/kernels.py)
    gpu_arch: str = "sm90"
    #: the GPU's multiprocessors and threads per multiprocessor (0: the architecture's usual part,
    #: kernels.GPU_SHAPES): how a CUDA reduction splits across blocks, and so its staging buffer
    gpu_multiprocessors: int = 0
    gpu_threads_per_multiprocessor: int = 0
    #: device cpu: the instruction-set class the CPU kernels follow (kernels.CPU_ISAS); None: this machine's
    cpu_isa: str | None = None
    #: a node's host RAM for offloaded states (--host-memory); None: no host verdict
    host_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise SettingsError(f"--gpus must be at least 1, got {self.gpus}")
        if self.gpus > MAX_GPUS:
            raise SettingsError(f"--gpus {self.gpus} is more than the {MAX_GPUS:,} GPUs memplan sizes")
        if self.gpus_per_node < 1:
            raise SettingsError(f"--gpus-per-node must be at least 1, got {self.gpus_per_node}")
        if self.gpus_per_node > MAX_GPUS_PER_NODE:
            raise SettingsError(f"--gpus-per-node {self.gpus_per_node} is more than the {MAX_GPUS_PER_NODE:,} "
                                "GPUs any node holds")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise SettingsError(f"gpus({self.gpus}) is not a multiple of gpus_per_node({self.gpus_per_node})")
        if self.device not in ("cuda", "cpu"):
            raise SettingsError(f"--device must be cuda or cpu, got {quote(self.device)}")
        if self.blas_workspace_bytes < 0:
            raise SettingsError(f"--cublas-workspace must not be negative, got {self.blas_workspace_bytes}")

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)


@dataclass(frozen=True)
class RankState:
    """One rank's state that the engine derives (accounting.Layout, memplan/parallel/), not the user: kept apart
    from the job's settings so that what was asked (memplan/request.py) and what one rank holds stay distinct."""

    #: a pipeline stage: the schedule computes the loss outside the stage's module, after its root's forward has
    #: ended and before its root's backward begins (torch.distributed.pipelining _maybe_compute_loss)
    pipeline_stage: bool = False
    #: a pipeline rank's receive buffers per sample of the micro-batch, allocated once and kept
    #: (memplan/parallel/pipeline.py recv_buffers)
    pipeline_buffer_bytes: int = 0
    #: FSDP2's unsharded gradient accumulators of a pipeline rank, from its first backward to the reduce after its
    #: last (accounting.Layout.at): held through the micro-batches, not between steps
    pipeline_accumulator_bytes: int = 0
    #: NCCL communicators a model-parallel rank adds to its data-parallel group's: its TP, PP, CP and EP groups
    model_parallel_groups: int = 0


@dataclass(frozen=True, kw_only=True)
class Settings:
    strategy: Strategy
    recipe: Recipe
    optimizer: Optimizer
    cluster: Cluster
    optimizer_impl: str | None = None  #: foreach | fused | single-tensor; None -> the framework's default
    micro_batch: int = 1
    seq_len: int = 2048
    #: an encoder-decoder's decoder length (its labels per sample; model/tasks.py SEQ2SEQ); None: no decoder input
    target_len: int | None = None
    #: a vision-language model's images per sample (model/tasks.py IMAGE_TEXT; their tokens are in seq_len); None:
    #: a model that takes no images
    images: int | None = None
    #: a patch-grid vision-language model's image (height, width) in pixels (model/tasks.py PATCH_GRID_MODELS,
    #: --image-size); None: a model whose images are its config's size, or that takes none
    image_size: tuple[int, int] | None = None
    grad_accum: int = 1
    recompute: str = "none"
    attention: str = "sdpa"  #: sdpa: the device's own kernel choice; flash: flash asked for; eager
    #: torch.compile (inductor): none | blocks | model (memplan/activations/tracing/compiled.py)
    compile: str = "none"
    #: float8 training: torchao's Float8Linear recipe (tensorwise, rowwise, rowwise_with_gw_hp; precision.py
    #: FLOAT8_PRECISIONS) on the bf16 compute of ``recipe``; "none": none
    float8: str = "none"
    #: the linears float8 training leaves in bf16 (precision.py FLOAT8_KEEP): output | first-last
    float8_keep: str = "output"
    #: FSDP2 all-gathers the float8 weights in float8 (frameworks/fsdp2.py float8_gathered)
    float8_all_gather: bool = False
    ds: DeepSpeedKnobs = field(default_factory=DeepSpeedKnobs)
    torch: TorchKnobs = field(default_factory=TorchKnobs)
    horovod: HorovodKnobs = field(default_factory=HorovodKnobs)
    overheads: Overheads = field(default_factory=Overheads)
    #: the traced activation profile (activations.TracedProfile); None -> the analytic profile
    activation_profile: Any = None
    #: PYTORCH_CUDA_ALLOC_CONF for the caching allocator's replay ("" : PyTorch's defaults)
    allocator_conf: str = ""
    #: the LoRA adapter the inventory carries (memplan/model/lora.py LoraSpec; the inventory is lora.apply's);
    #: None: every parameter trains
    lora: Any = None
    #: the module paths whose parameters do not train (--freeze: model/freeze.py; the inventory's frozen_paths)
    frozen: tuple[str, ...] = ()
    #: the parameters that require a gradient and get none in the traced step (no loss reads them:
    #: options.unreached_params), by their inventory names
    unreached: tuple[str, ...] = ()
    #: DeepSpeed ZeRO-3 leaf modules' paths (memplan/model/z3_leaf.py), each fetched and released whole
    z3_leaves: tuple[str, ...] = ()
    #: tensor / sequence / pipeline parallelism (memplan/parallel/degrees.py Parallel); None: data parallelism alone
    parallel: Any = None
    #: what the engine derives for one rank of a model-parallel job (accounting.Layout); a data-parallel job's
    #: ranks are alike and keep the default
    rank: RankState = field(default_factory=lambda: RankState())

    def __post_init__(self) -> None:
        for name, most in (("micro_batch", MAX_MICRO_BATCH), ("seq_len", MAX_SEQ_LEN), ("grad_accum", MAX_GRAD_ACCUM),
                           ("target_len", MAX_SEQ_LEN)):
            value = getattr(self, name)
            if value is None:
                continue
            if value < 1:
                raise SettingsError(f"{name.replace('_', '-')} must be at least 1, got {value}")
            if value > most:
                raise SettingsError(f"{name.replace('_', '-')} {value:,} is more than the {most:,} memplan sizes")
        if self.optimizer_impl is not None and self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise SettingsError(f"unknown optimizer implementation {quote(self.optimizer_impl)}; "
                                f"valid: {', '.join(OPTIMIZER_IMPLS)}")


def shard_group_size(s: Settings) -> int:
    """Ranks a sharded tensor is split over (HSDP: within a node, or --hsdp-shard-size)."""
    c = s.cluster
    if not (s.strategy.shard_optimizer or s.strategy.shard_params or s.strategy.shard_grads):
        return 1
    if s.strategy.shard_within_node:
        size = s.torch.hsdp_shard_size or c.ranks_per_node
        if size < 1 or c.gpus % size:
            raise SettingsError(f"gpus({c.gpus}) is not a multiple of the HSDP shard size({size})")
        return size
    return c.gpus


def reshard_after_forward(s: Settings) -> bool | int:
    """reshard_after_forward as the job asks for it (--reshard-after-forward, else the strategy row's): what the
    harness passes to FSDP; the buffer models read it as their FSDP version does (frameworks/fsdp1.py, fsdp2.py)."""
    raf = s.torch.reshard_after_forward
    return s.strategy.reshard_after_forward if raf is None else raf


def optimizer_impl(s: Settings) -> str:
    """The optimizer implementation the job runs: the one given, else the framework's default on the device."""
    if s.optimizer_impl:
        return s.optimizer_impl
    if s.optimizer.kernel and (s.cluster.device == "cuda" or s.optimizer.any_device):
        return s.optimizer.kernel
    if s.cluster.device == "cpu":
        # torch.optim's default off CUDA (_default_to_fused_or_foreach -> single tensor). DeepSpeed on CPU
        # (DS_BUILD_OPS=0) steps a torch optimizer on its flat fp32 partition, so the two temporaries of
        # `exp_avg_sq.sqrt() / bias_correction2_sqrt` are partition-sized: measured by the harness
        # (docs/accuracy.md), 2 x 4 bytes x partition at the ZeRO-2 step peak.
        return "single-tensor"
    # DeepSpeed builds FusedAdam on CUDA; torch.optim defaults to foreach on CUDA.
    return "fused" if s.strategy.zero_stage is not None else "foreach"


def with_gpus(s: Settings, gpus: int) -> Settings:
    """The same job on ``gpus`` GPUs (a one-GPU strategy has no other count: SettingsError)."""
    if s.strategy.one_gpu and gpus != 1:
        raise SettingsError(f"--strategy {s.strategy.name} runs on one GPU, not {gpus}")
    return replace(s, cluster=replace(s.cluster, gpus=gpus))

