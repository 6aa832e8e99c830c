"""The strategy table: what each strategy shards, over which group, how it lays tensors out, what it buffers.

Strategies are data. The accounting engine reads these fields and never branches on a strategy's name, so
adding a strategy means adding a row here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memplan.errors import SettingsError
from memplan.inputs import quote

# Parameter layouts (how a shard's size follows from the tensors):
#: DeepSpeed ZeRO-1/2: every param group flattened, padded to a multiple of 2 * dp_size
#: (stage_1_and_2.py: flatten_dense_tensors_aligned(..., nccl_start_alignment_factor * dp_size), factor 2).
FLAT_ALIGNED = "flat-aligned"
#: DeepSpeed ZeRO-3: each parameter split alone, ceil(numel / dp_size) per rank (partition_parameters.py,
#: _padding_size); tensors with numel <= stage3_param_persistence_threshold stay gathered.
PER_PARAM_NUMEL = "per-param-numel"
#: FSDP2 fully_shard: each parameter chunked on dim 0, padded to ceil(dim0 / shard) rows per rank
#: (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, padded sharded size).
PER_PARAM_DIM0 = "per-param-dim0"
#: FSDP1: one FlatParameter per wrapped block, padded to a multiple of the shard count (_flat_param.py).
FLAT_PER_BLOCK = "flat-per-block"
#: FSDP1 with no auto-wrap policy: one FlatParameter for the whole model, the root's (_flat_param.py pads it to
#: a multiple of the shard count)
FLAT_WHOLE = "flat-whole"
#: torch ZeroRedundancyOptimizer: whole parameters assigned greedily, largest first, to the least loaded rank
#: (torch/distributed/optim/zero_redundancy_optimizer.py, _partition_parameters); the worst rank is predicted.
GREEDY_WHOLE = "greedy-whole"
REPLICATED = "replicated"


@dataclass(frozen=True, kw_only=True)
class Strategy:
    name: str
    framework: str  #: deepspeed | torch-ddp | torch | horovod | fsdp2 | fsdp1 (the default recipe, optimizer impl)
    description: str
    shard_optimizer: bool  #: optimizer states and master weights split across the shard group
    shard_grads: bool  #: reduced gradients kept only for the rank's shard
    shard_params: bool  #: parameters split; gathered block by block for compute
    layout: str  #: how shards are sized (see the constants above)
    #: Reduced grads stay allocated between steps (ZeRO-3's grad_partitions_flat_buffer).
    persistent_grads: bool = False
    #: Full-size grads exist at the end of backward before any sharding (DDP, ZeRO-1, ZeRO-0).
    full_grads_in_backward: bool = True
    #: DDP reducer buckets: one flat buffer per bucket covering every gradient, allocated at construction.
    ddp_buckets: bool = False
    #: Horovod's tensor fusion: gradients all-reduced in place through one persistent fusion buffer (its knobs:
    #: Settings.horovod), each gradient's compressed copy held from its hook to the step.
    fusion_buffer: bool = False
    #: DeepSpeed's ipg reduce buckets (reduce_bucket_size elements, doubled with overlap_comm).
    ds_ipg_buckets: bool = False
    #: The optimizer keeps its own fp32 copy of the parameters it updates, whatever their dtype (DeepSpeed's
    #: ZeRO optimizers: stage_1_and_2.py single_partition_of_fp32_groups = the partition .clone().to(
    #: master_weights_and_grads_dtype); stage3.py _create_fp32_partitions; measured with fp32 params: ZeRO-3,
    #: 2 ranks, torch-amp, 17,830,912 B = 4 bytes x the partition).
    fp32_master_copy: bool = False
    #: ZeRO stage (DeepSpeed only), for ds_config and display; None for others.
    zero_stage: int | None = None
    #: Parameters are sharded within a node and replicated across nodes (HSDP).
    shard_within_node: bool = False
    #: FSDP reshard_after_forward: True (reshard), False (keep unsharded until backward).
    reshard_after_forward: bool = True
    #: The framework's memory model (memplan/frameworks): ddp | zero12 | zero3 | fsdp2 | fsdp1
    memory_model: str
    #: Runs on one GPU only (no data parallelism)
    one_gpu: bool = False
    #: Bytes each rank sends per step, in parameter-sized messages (Rajbhandari et al. 2020, Section 7: an
    #: all-reduce is 2 Psi, ZeRO-3's extra all-gather makes 3 Psi). Only `memplan plan` reads it, to break ties.
    comm_volume: int = 2


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    # one GPU, no wrapper: a fine-tuning script's model.to("cuda") and an optimizer; gradients kept to the step as
    # under DDP, without the Reducer's buckets (the default at --gpus 1)
    Strategy(name="single", framework="torch", memory_model="ddp",
             layout=REPLICATED, shard_optimizer=False, shard_grads=False, shard_params=False, one_gpu=True,
             comm_volume=0, description="one GPU, plain PyTorch: no DDP wrapper, no reducer buckets"),
    Strategy(name="ddp", framework="torch-ddp", memory_model="ddp",
             layout=REPLICATED, shard_optimizer=False, shard_grads=False, shard_params=False, ddp_buckets=True,
             description="PyTorch DistributedDataParallel (what Horovod does too): everything replicated"),
    # Horovod's DistributedOptimizer (horovod/torch/optimizer.py): each gradient all-reduced in place from its
    # accumulate hook through the persistent fusion buffer (horovod/common/fusion_buffer_manager.cc), no
    # reducer buckets; gradients kept to the step as under DDP
    Strategy(name="horovod", framework="horovod", memory_model="ddp",
             layout=REPLICATED, shard_optimizer=False, shard_grads=False, shard_params=False, fusion_buffer=True,
             description="Horovod DistributedOptimizer: everything replicated, gradients all-reduced through its "
                         "fusion buffer"),
    # DeepSpeed stage 0 as 0.19.8 runs it (engine.py _do_optimizer_sanity_check: without ZeRO the gradients
    # accumulate in the parameters' dtype, fp32 accumulation of bf16 parameters being its NotImplementedError):
    # 16-bit parameters go to FP16_Optimizer (DeepSpeed's FusedAdam: one flat fp32 master group) or
    # FP16_UnfusedOptimizer (a torch optimizer: an fp32 copy per parameter), fp32 ones to the torch optimizer
    # itself; the gradients all-reduced after backward (buffered_allreduce_fallback) and, with a 16-bit wrapper,
    # copied to fp32 for the step. Every tensor whole.
    Strategy(name="zero0", framework="deepspeed", memory_model="zero12",
             layout=REPLICATED, shard_optimizer=False, shard_grads=False,
             shard_params=False, zero_stage=0,
             description="DeepSpeed stage 0: data parallel with its FP16_Optimizer (16-bit gradients copied to fp32 "
                         "at the step; fp32 master and states)"),
    # ZeRO-1 runs DeepSpeedZeroOptimizer too: with contiguous_gradients (the default) its gradient hooks set up
    # the ipg bucket buffer(s) in every backward (stage_1_and_2.py setup_buckets), as ZeRO-2 does (measured:
    # 1 GB at the default reduce_bucket_size, docs/accuracy.md)
    Strategy(name="zero1", framework="deepspeed", memory_model="zero12",
             layout=FLAT_ALIGNED, shard_optimizer=True, shard_grads=False,
             shard_params=False, fp32_master_copy=True, zero_stage=1, ds_ipg_buckets=True,
             description="DeepSpeed ZeRO-1: optimizer states and fp32 master partitioned"),
    Strategy(name="zero2", framework="deepspeed", memory_model="zero12",
             layout=FLAT_ALIGNED, shard_optimizer=True, shard_grads=True,
             shard_params=False, fp32_master_copy=True, zero_stage=2, full_grads_in_backward=False, ds_ipg_buckets=True,
             description="DeepSpeed ZeRO-2: + gradients partitioned (reduced bucket by bucket in backward)"),
    Strategy(name="zero3", framework="deepspeed", memory_model="zero3",
             layout=PER_PARAM_NUMEL, shard_optimizer=True, shard_grads=True,
             shard_params=True, fp32_master_copy=True, zero_stage=3, full_grads_in_backward=False, ds_ipg_buckets=True,
             persistent_grads=True, comm_volume=3,
             description="DeepSpeed ZeRO-3: + parameters partitioned, gathered module by module"),
    Strategy(name="zero-optimizer", framework="torch-ddp", memory_model="ddp",
             layout=GREEDY_WHOLE, shard_optimizer=True, shard_grads=False, shard_params=False, ddp_buckets=True,
             comm_volume=3,
             description="DDP + torch ZeroRedundancyOptimizer: optimizer states of whole params, greedily"),
    Strategy(name="fsdp-full", framework="fsdp2", memory_model="fsdp2",
             layout=PER_PARAM_DIM0, shard_optimizer=True, shard_grads=True,
             shard_params=True, full_grads_in_backward=False, comm_volume=3,
             description="FSDP FULL_SHARD (FSDP2 fully_shard, reshard_after_forward=True)"),
    Strategy(name="fsdp-grad-op", framework="fsdp2", memory_model="fsdp2",
             layout=PER_PARAM_DIM0, shard_optimizer=True,
             shard_grads=True, shard_params=True, full_grads_in_backward=False, reshard_after_forward=False,
             description="FSDP SHARD_GRAD_OP (reshard_after_forward=False: params stay gathered until backward)"),
    Strategy(name="fsdp-no-shard", framework="fsdp2", memory_model="fsdp2",
             layout=REPLICATED, shard_optimizer=False, shard_grads=False,
             shard_params=False, full_grads_in_backward=True,
             description="FSDP NO_SHARD: replicated like DDP, under FSDP's mixed precision"),
    Strategy(name="hsdp", framework="fsdp2", memory_model="fsdp2",
             layout=PER_PARAM_DIM0, shard_optimizer=True, shard_grads=True,
             shard_params=True, full_grads_in_backward=False, shard_within_node=True, comm_volume=3,
             description="HYBRID_SHARD / HSDP: full shard within a node (2-D mesh), replicated across nodes"),
)}

#: FSDP1 (FullyShardedDataParallel, --fsdp-version 1): the FSDP rows with one FlatParameter per wrapped block
FSDP1_STRATEGIES: dict[str, Strategy] = {
    name: replace(row, framework="fsdp1", layout=FLAT_PER_BLOCK, memory_model="fsdp1")
    for name, row in STRATEGIES.items() if row.memory_model == "fsdp2"}

#: DeepSpeed's --stage shorthand.
STAGE_TO_STRATEGY = {0: "zero0", 1: "zero1", 2: "zero2", 3: "zero3"}

#: Default recipe per framework (DESIGN.md: DeepSpeed -> deepspeed-bf16, FSDP -> fsdp-bf16, DDP -> torch-amp).
DEFAULT_RECIPE = {"deepspeed": "deepspeed-bf16", "fsdp2": "fsdp-bf16", "fsdp1": "fsdp-bf16",
                  "torch-ddp": "torch-amp", "torch": "torch-amp", "horovod": "torch-amp"}


def get_strategy(name: str, fsdp_version: int = 2, fsdp_wrap: str = "block") -> Strategy:
    """A row of the table; with fsdp_version 1, the FSDP rows' FSDP1 form (other rows are the same), whose
    FlatParameters are one per block, or one for the whole model without wrapping (``fsdp_wrap`` "none")."""
    try:
        row = STRATEGIES[name]
    except KeyError:
        raise SettingsError(f"unknown strategy {quote(name)}; valid: {', '.join(STRATEGIES)}") from None
    if fsdp_version != 1 or name not in FSDP1_STRATEGIES:
        return row
    row = FSDP1_STRATEGIES[name]
    return replace(row, layout=FLAT_WHOLE) if fsdp_wrap == "none" else row
