"""What the engine answers (memplan/accounting.py): the Plan of one configuration with its phases, and the step's
named timeline. Plain frozen data."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from memplan.model.inventory import ParamInventory
from memplan.settings import Settings
from memplan.timeline import StepMoment


PHASE_NAMES = ("forward", "backward-start", "backward", "backward-end", "optimizer-step")


class Phase(IntEnum):
    """The phases of a step, in order: a Plan's ``phases`` and the engine's per-phase rows are indexed by them."""

    FORWARD = 0  #: forward's end, the loss included
    BACKWARD_START = 1  #: the loss backward and the head's (the most alive as backward begins)
    BACKWARD = 2  #: inside the blocks' backward
    BACKWARD_END = 3  #: after the last gradient, before the step
    OPTIMIZER_STEP = 4

    @property
    def label(self) -> str:
        """The name the output and the JSON use."""
        return PHASE_NAMES[self]


@dataclass(frozen=True)
class PhaseBytes:
    """What one phase of the step holds, by category."""

    name: str
    weights_bytes: int
    master_weights_bytes: int
    grads_bytes: int
    optimizer_states_bytes: int
    activations_bytes: int
    buffers_bytes: int

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.master_weights_bytes + self.grads_bytes + self.optimizer_states_bytes
                + self.activations_bytes + self.buffers_bytes)


@dataclass(frozen=True)
class Plan:
    """The per-GPU prediction for one configuration (worst rank)."""

    settings: Settings
    inventory: ParamInventory
    phases: tuple[PhaseBytes, ...]
    peak: PhaseBytes
    overhead_bytes: int
    overhead_detail: dict[str, int]
    host_bytes_per_node: int
    shard_group: int
    #: bytes held between steps (model states, grads kept across steps, buffers allocated at setup)
    between_steps_bytes: int
    assumptions: dict[str, Any]
    #: per rank, by category: what offload keeps in host memory (sums to host_bytes_per_node / ranks per node)
    host_detail: dict[str, int] = field(default_factory=dict)
    #: the caching allocator replayed (reserved.Reserved), or None with reserved_why saying why not
    reserved: Any = None
    reserved_why: str | None = None
    #: under tensor or pipeline parallelism (memplan/parallel/): this plan is the most loaded rank's (its share
    #: of the model, its data-parallel group), and ``layout`` holds the job as given and every pipeline rank's
    #: figures (accounting.Layout)
    layout: Any = None
    #: the replay under the card's limits (reserved.Capped: flushes, out of memory), where a card is given
    capped: Any = None
    #: the card bytes the verdict compares with the card (accounting._verdict), where the capped replay ran
    verdict_required_bytes: int | None = None
    #: per GPU per optimizer step (comm.communication; under model parallelism with the worst rank's tensor- and
    #: pipeline-parallel traffic)
    communication: dict[str, Any] = field(default_factory=dict)
    #: the node's host memory for offloaded states (host.host_report), None where nothing is offloaded
    host: dict[str, Any] | None = None
    #: the user's flat allocator percentage (--fragmentation-percent), which the reserved peak then takes; None
    #: where it is not given or off CUDA
    fragmentation_percent: int | None = None
    #: why the reserved and required figures are only bounds from below (the allocated peak, the caching
    #: allocator not replayed for this job or one of its pipeline ranks, no percentage given); None: they are not
    bounded: str | None = None

    @property
    def reserved_peak_bytes(self) -> int | None:
        """Predicted torch.cuda.max_memory_reserved: replayed, or with the user's flat fragmentation term, or (where
        ``bounded``) the allocated peak, a bound from below."""
        if self.settings.cluster.device != "cuda":
            return None
        return self.peak_bytes + self.overhead_detail.get("allocator_bytes",
                                                          self.overhead_detail.get("fragmentation_bytes", 0))

    @property
    def peak_bytes(self) -> int:
        return self.peak.total_bytes

    @property
    def uncapped_required_bytes(self) -> int:
        """The reserved peak of the uncapped replay (or the allocated peak and the user's flat share, or the allocated
        peak alone where ``bounded``) + CUDA context + NCCL."""
        return self.peak_bytes + self.overhead_bytes

    @property
    def required_bytes(self) -> int:
        """What the verdict compares with the card: the capped replay's reserved peak and what lies outside the
        allocator (and, under a per_process_memory_fraction, the part of the card the fraction leaves out), where
        that replay ran; else the uncapped figure."""
        if self.verdict_required_bytes is not None:
            return self.verdict_required_bytes
        return self.uncapped_required_bytes

    @property
    def fits(self) -> bool | None:
        """Whether the job fits the card; None without a card, or where the figure is only a bound from below
        (``bounded``) that the card holds: then it may or may not fit."""
        mem = self.settings.cluster.gpu_memory_bytes
        if mem is None:
            return None
        if self.required_bytes > mem:
            return False
        return None if self.bounded else True

    @property
    def headroom_bytes(self) -> int | None:
        mem = self.settings.cluster.gpu_memory_bytes
        return None if mem is None else mem - self.required_bytes

    @property
    def host_fits(self) -> bool | None:
        """Whether the offloaded states fit a node's host RAM (--host-memory), pinned buffers rounded as PyTorch
        rounds them (memplan/host.py); None without --host-memory or without offload."""
        return None if self.host is None else self.host["fits"]


@dataclass(frozen=True)
class StepTimeline:
    """Everything a rank holds but activations, at each phase and named moment of the step (the engine's view
    before the activation profile is added): model states, gradients and buffers per phase, the named moments
    of the framework's buffer model (timeline.StepMoment: grads and buffers with the persistent ones, and
    their sum with the model states), and the assumptions they rest on."""

    weights: int
    master_weights: int
    optimizer_states: int
    grads: dict[str, int]
    buffers: dict[str, int]
    moments: tuple[StepMoment, ...]
    #: bytes per element of a block's own gradients inside its backward
    grad_width: int
    #: the block moments count only the gradients whose hook has not taken them yet (ZeRO-3)
    grads_held: bool
    #: what a parameter's gradient hook allocates (BLOCK_GRADIENT_HOOK; memplan/timeline.py HookTransient)
    hook_transient: Any
    assumptions: dict[str, Any]


@dataclass(frozen=True)
class EvaluatedMoment:
    """A named moment with its activations (read off the profile) and the block's own grads or the hook's
    transient; ``total`` is what the rank holds then."""

    moment: StepMoment
    activations: int
    own_bytes: int

    @property
    def total(self) -> int:
        return self.moment.total + self.activations + self.own_bytes
