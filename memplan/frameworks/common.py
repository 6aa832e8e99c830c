"""What every framework's memory model reads (the job) and the defaults a model keeps unless it says otherwise."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memplan import layouts
from memplan.model.inventory import ParamInventory
from memplan.settings import Settings, shard_group_size
from memplan.timeline import BufferMoment, BufferTimeline, Moment


@dataclass(frozen=True)
class Job:
    """One configuration as the buffer models read it: the inventory, the settings and what follows from them."""

    inv: ParamInventory
    s: Settings
    #: ranks a sharded tensor is split over
    n: int
    #: the layout's sizes on the worst rank (layouts.layout_sizes)
    lay: layouts.LayoutSizes
    #: DeepSpeed ZeRO-Offload: the optimizer (stages 1-3) and the parameters (stage 3) on the host
    offload_optimizer: bool
    offload_param: bool
    #: FSDP's CPUOffloadPolicy: sharded parameters, gradients and optimizer states on the host
    cpu_offload: bool
    #: DeepSpeed overlap_comm as DeepSpeed resolves it (True for stage 3, False otherwise)
    overlap: bool

    @classmethod
    def of(cls, inv: ParamInventory, s: Settings, model: FrameworkModel) -> Job:
        st, n = s.strategy, shard_group_size(s)
        inv = model.units(inv, s)
        return cls(inv=inv, s=s, n=n, lay=layouts.layout_sizes(inv, st.layout, n, s.ds.param_persistence_threshold),
                   offload_optimizer=model.zero_offload and s.ds.offload_optimizer,
                   offload_param=st.zero_stage == 3 and s.ds.offload_param,
                   cpu_offload=model.cpu_offload_policy and s.torch.cpu_offload,
                   overlap=s.ds.overlap_comm if s.ds.overlap_comm is not None else st.zero_stage == 3)

    @property
    def psi(self) -> int:
        """Elements that get gradients: every parameter, or the trainable ones where some are frozen (LoRA)."""
        return self.inv.trainable_params

    @property
    def gathers(self) -> layouts.GatherSizes:
        """Gathered sizes by block (layouts.gather_sizes): every parameter, frozen or not."""
        return layouts.gather_sizes(self.inv, self.s.strategy.layout, self.n)

    @property
    def grad_gathers(self) -> layouts.GatherSizes:
        """The same sizes over the parameters that get gradients (the reduce side): ``gathers`` unless some
        parameters are frozen."""
        return layouts.gather_sizes(self.inv.trainable_inventory, self.s.strategy.layout, self.n)


@dataclass(frozen=True)
class Grads:
    """Gradients per rank on the device: alive at backward's end, and kept between steps."""

    end: int
    persist: int


@dataclass
class OffloadedGrads:
    """What a framework's offload adds beside the gradients it moves to the host."""

    #: the optimizer step's check on a host gradient buffer, where host and device share one allocator (CPU)
    step_scratch: int = 0
    #: a gradient buffer kept on the device for the copies to the host
    device_buffer: int = 0
    #: gradients still kept on the device across micro-steps (ZeRO-1 under gradient accumulation: reduced to the
    #: host at the boundary only)
    kept_grads: int = 0


@dataclass(frozen=True)
class FourBitBase:
    """How a framework holds a QLoRA 4-bit base: its packed codes in uint8 (bitsandbytes' default) or packed into
    a float bnb_4bit_quant_storage (a parameter like the rest), and each QuantState (never a parameter)."""

    #: what becomes of a uint8 storage
    uint8: str = "kept whole on every GPU"
    #: why a uint8 storage cannot run under the framework, or None where it can
    uint8_why_not: str | None = None
    #: what becomes of the packed float parameters
    packed: str = "kept whole on every GPU"
    #: the framework shards the packed float parameters (a float bnb_4bit_quant_storage saves memory over uint8)
    shards_packed: bool = False
    #: the 4-bit model is loaded whole onto every GPU before the framework shards it (the replays build it so)
    loaded_whole: bool = False
    #: the wrapper would cast the packed float storage for compute (turning the codes into numbers): why, for a
    #: recipe, or None
    cast_why: Callable[[Any], str | None] = lambda rc: None


@dataclass(frozen=True)
class StepIn:
    """The optimizer step as every framework has it, before the framework's own flatten or sub-groups."""

    grads: int
    buffers: int
    persistent: int
    scratch: int
    impl: str
    grads_persist: int
    master_bytes: int


def device_weights(job: Job) -> int:
    """The parameters a rank stores: its shard in the parameter dtype."""
    # a 4-bit base's storage (QLoRA) is kept whole and in its own dtypes (uint8 and fp32 quantisation state)
    rc = job.s.recipe
    # PEFT's fp32 adapters on a half-precision base (set only where parameters are replicated: options.py)
    upcast = (rc.adapter_bytes - rc.param_bytes) * job.inv.adapter_params if rc.adapter_bytes else 0
    return rc.param_bytes * job.lay.shard_numel + job.inv.quantized_bytes + upcast


def grads_at_end(job: Job) -> int:
    """Gradients alive at backward's end: every one where they are whole then, else the rank's shard in the
    reduce dtype (FSDP's padded shards)."""
    st, rc = job.s.strategy, job.s.recipe
    if st.full_grads_in_backward and st.framework not in ("fsdp2", "fsdp1"):
        return rc.grad_bytes * (job.psi if not st.shard_params else job.lay.grad_shard_numel)
    # FSDP, NO_SHARD included: each gradient reduced in the reduce dtype and kept as the sharded parameter's
    # gradient, in its dtype (FSDP2 foreach_reduce; FSDP1 _post_backward_hook casts it back): with fsdp-bf16 the
    # whole model's gradients in fp32 on every rank (checked: fully_shard over a (2, 1) mesh, every p.grad float32
    # and whole)
    return rc.reduced_grad_bytes * job.lay.optimizer_numel


def layout_tensors(job: Job) -> tuple[tuple[tuple[int, ...], int], ...]:
    """The tensors the optimizer steps as the layout hands them (layouts.LayoutSizes.shard_shapes)."""
    return job.lay.shard_shapes


def no_offload(job: Job, grads: Grads, host_by: dict[str, int]) -> OffloadedGrads:
    return OffloadedGrads()


def no_pinned(inv: ParamInventory, s: Settings, n: int) -> list[int]:
    return []


def same_step(job: Job, step: StepIn) -> tuple[int, int, dict[str, Any]]:
    return step.grads, step.buffers, {}


def unreduced_grad_moments(g: Any, grad_bytes: int, psi: int) -> list[BufferMoment]:
    """Block moments where every gradient stays as autograd made it until after backward (DDP; ZeRO-1 without
    overlap_comm): inside the last block the head's grads exist, inside the first all but the embedding's and
    the first block's (each block's own grads are added by the profile's block moments). A root tensor between two
    stacks (layouts.GatherSizes.root_between) has its gradient inside the earlier stack's blocks, not the later's."""
    if not g.block_numels:
        return []
    return [BufferMoment(0, grad_bytes * g.root_head, Moment.INSIDE_LAST_BLOCK_BACKWARD),
            BufferMoment(0, grad_bytes * (psi - (g.root - g.root_head - g.root_between) - g.block_numels[0]),
                         Moment.INSIDE_FIRST_BLOCK_BACKWARD),
            # every gradient made before the point is in the profile's (profile.block_moments' fifth)
            BufferMoment(0, 0, Moment.INSIDE_ANY_BLOCK_BACKWARD)]


#: the loss's and the head's backward with the head's gradient as autograd makes it (a new tensor from the
#: weight-gradient GEMM, before any hook has taken it): what is gathered at the loss, no reduce bucket yet
#: (ZeRO-1/2 set theirs up in the first gradient hook). Measured with the harness: ZeRO-3 at 1 rank peaks at the
#: head's weight-gradient GEMM, 1.31 MB above the loss's own peak (llama-3-8b, 2 blocks).
LOSS = BufferMoment(0, 0, Moment.LOSS_BACKWARD)


@dataclass(frozen=True)
class FrameworkModel:
    """A framework's memory model: each part defaults to what every framework shares."""

    name: str
    buffers: Callable[[Job, Grads], BufferTimeline]
    weights: Callable[[Job], int] = device_weights
    grads_at_end: Callable[[Job], int] = grads_at_end
    #: the gradients kept across micro-steps under gradient accumulation, from those alive at backward's end
    accumulated_grads: Callable[[Job, int], int] = lambda job, end: end
    #: gradient bytes held through the whole step, forward included, in storage the framework keeps for the run
    #: (DDP's gradient_as_bucket_view: the Reducer's buckets are the gradients); 0 where gradients come and go
    whole_step_grads: Callable[[Job], int] = lambda job: 0
    #: the gradient side of an offload: moves gradients to ``host_by`` and says what stays on the device
    offload: Callable[[Job, Grads, dict[str, int]], OffloadedGrads] = no_offload
    #: the optimizer step's (grads, buffers, assumptions), given the step every framework has
    step: Callable[[Job, StepIn], tuple[int, int, dict[str, Any]]] = same_step
    #: the framework offers DeepSpeed's ZeRO-Offload (offload_optimizer, offload_param)
    zero_offload: bool = False
    #: the framework offers FSDP's CPUOffloadPolicy (--cpu-offload)
    cpu_offload_policy: bool = False
    #: with it, each reduced gradient leaves the device as it is reduced (FSDP2 foreach_reduce: .to("cpu")); False:
    #: the reduced shards stay on the device to backward's end (FSDP1 keeps _saved_grad_shard until the final
    #: callback's prepare_gradient_for_optim points .grad at _cpu_grad)
    offloads_each_reduced_grad: bool = False
    #: the framework computes with views of flat parameters (FSDP1, use_orig_params=False: split() views), which
    #: are not leaves, so torch.autocast casts their weights anew at every use and caches none (autocast_mode.cpp
    #: cached_cast); the traced step (traced with leaf parameters) is read accordingly
    computes_with_views: bool = False
    #: the buffers the framework pins on the host (bytes each, as requested; memplan/host.py rounds them)
    pinned_host: Callable[[ParamInventory, Settings, int], list[int]] = no_pinned
    #: why the model cannot take frozen parameters (LoRA), or None where it can (layouts._with_frozen)
    frozen_why_not: str | None = None
    #: why a 16-bit model cannot train as loaded under autocast (the framework casts it to its own mixed
    #: precision), or None where it can (plain PyTorch, DDP)
    half_autocast_why_not: str | None = None
    #: the tensors the worst rank's optimizer steps, (shape, elements) each, as the framework hands them: what
    #: Adafactor factors and bitsandbytes quantizes (precision.Optimizer.shape_dependent)
    optimizer_tensors: Callable[[Job], tuple[tuple[tuple[int, ...], int], ...]] = layout_tensors
    #: why an optimizer whose step depends on its tensors (precision.Optimizer.shape_dependent) cannot step what
    #: the framework hands it, or None where it can
    shaped_optimizer_why_not: str | None = None
    #: the inventory with each tensor's unit as the job's wrapping makes them (ParamTensor.unit; the inventory
    #: itself where the blocks are the units)
    units: Callable[[ParamInventory, Settings], ParamInventory] = lambda inv, s: inv
    #: why the job's wrapping (--fsdp-wrap) cannot wrap this model, or None where it can
    wrap_why_not: Callable[[ParamInventory, Settings], str | None] = lambda inv, s: None
    #: what becomes of a parameter that requires a gradient no loss reads (Settings.unreached), for these
    #: settings, and why: "tensor" (its .grad stays None, and torch's optimizers make a None gradient no state: one
    #: GPU, DDP with find_unused_parameters, FSDP2's per-parameter shards), "unit" (a flat parameter gets a gradient
    #: where any of its parameters does: FSDP1, where a unit none of whose parameters is read gets none), or
    #: "trained" (DeepSpeed's flat partitions and states take every parameter that requires grad; Horovod's
    #: synchronize() gives a missing gradient zeros)
    unreached: Callable[[Settings], tuple[str, str]] = lambda s: (
        "trained", "still gradients and optimizer states: DeepSpeed keeps every parameter that requires grad in its "
                   "flat partitions")
    #: the module that replays the framework's allocations for the reserved peak (memplan/reserved.py): its
    #: replay(inv, s, config) and why_not(s); None where the framework's setup is not written down yet
    replay: str | None = None
    #: how it holds a QLoRA 4-bit base (bitsandbytes Params4bit, model/lora.py quantize_base)
    four_bit: FourBitBase = field(default_factory=lambda: FourBitBase())
