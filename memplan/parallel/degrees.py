"""The model-parallel degrees of a job (--tp, --pp, --vpp, --sp, --schedule, --ep, --cp) and the names every
parallelism shares: the two layouts and the keys a rank's config carries to the tracer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memplan.parallel import schedules


#: torch.distributed.pipelining's schedules (memplan/parallel/schedules.py; --schedule also takes torch's class names)
SCHEDULES = tuple(schedules.TORCH_NAMES)


TORCHTITAN = "torchtitan"


MEGATRON_DEEPSPEED = "megatron-deepspeed"


#: the schedules each layout runs (torch.distributed.pipelining get_schedule_class: 1F1B, GPipe,
#: Interleaved1F1B; DeepSpeed's PipelineEngine: TrainSchedule, a 1F1B)
LAYOUT_SCHEDULES = {TORCHTITAN: SCHEDULES, MEGATRON_DEEPSPEED: ("1f1b",)}


#: a rank config's key (rank_config) telling the tracer to run one expert-parallel rank (memplan/activations/substitutes.py
#: expert_parallel)
EP_KEY = "memplan_expert_parallel"


#: ... and one context-parallel rank (memplan/activations/substitutes_sdpa.py _ring)
CP_KEY = "memplan_context_parallel"


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """The model-parallel degrees of a job (--tp, --pp, --vpp, --sp, --schedule)."""

    tp: int = 1
    pp: int = 1
    #: virtual stages per pipeline rank (interleaved); None: the layout's default (torchtitan: 2 when interleaved)
    vpp: int | None = None
    sp: bool = False  #: sequence parallelism: the norms' and residuals' activations split over the TP ranks
    schedule: str = "1f1b"
    #: torchtitan's loss parallelism (its default): the head's logits stay split by vocabulary and the loss runs
    #: on each rank's share; False: they are gathered whole first (torchtitan's disable_loss_parallel, and
    #: transformers' own tensor parallelism, which Accelerate's parallelism_config runs: the head's plan is
    #: colwise_gather_output)
    loss_parallel: bool = True
    #: expert parallelism: each MoE layer's routed experts split over ep ranks of the data-parallel x TP group
    #: (whole experts per rank, tokens exchanged by all-to-all); their FSDP2 group is the rest, efsdp =
    #: dp x tp / ep (torchtitan's dp_shard_mod_ep; transformers' DistributedConfig efsdp_size)
    ep: int = 1
    #: context parallelism: each rank of a cp group holds 1/cp of every sequence (torchtitan's load-balanced
    #: chunks) and runs ring attention over the group (torch's context_parallel); the parameters are sharded (or
    #: replicated) over dp x cp, as torchtitan folds cp into its FSDP mesh (dp_shard_cp)
    cp: int = 1
    #: the activation profiles options.py made for the ranks' shares: (with the loss, without it)
    profiles: Any = field(default=None, compare=False)

    @property
    def active(self) -> bool:
        return (self.tp, self.pp, self.ep, self.cp) != (1, 1, 1, 1)

    @property
    def model_ranks(self) -> int:
        return self.tp * self.pp

    @property
    def virtual(self) -> int:
        if self.schedule in schedules.V_SHAPED:
            return 2  # ZB-V, DualPipeV: exactly two stages per rank, in a V
        # torchtitan's multi-stage schedules default to two stages per rank (pipeline_parallel.py
        # pipeline_module_split: stages_per_rank)
        return self.vpp or (2 if self.schedule in schedules.MULTI_STAGE else 1)

    @property
    def multi_stage(self) -> bool:
        """A schedule that runs more than one stage per rank."""
        return self.schedule in schedules.MULTI_STAGE
