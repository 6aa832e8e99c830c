"""One memory model per framework: what its buffers, gathers and not-yet-reduced gradients hold at each named
moment of a step (memplan/timeline.py), and how it changes model states, gradients and the optimizer step.

    ddp       PyTorch DDP's Reducer (and DDP + ZeroRedundancyOptimizer)
    zero12    DeepSpeed stages 0-2 (DeepSpeedZeroOptimizer; stage 0's FP16_Optimizer), with ZeRO-Offload
    zero3     DeepSpeed ZeRO-3 (the parameter coordinator's gathers and prefetch), with ZeRO-Offload
    fsdp2     FSDP2 fully_shard (and its NO_SHARD and HSDP rows)
    fsdp1     FSDP1 FullyShardedDataParallel (FlatParameter per block)

The strategy table (memplan/strategies.py) names the model each row uses; the engine looks it up here and never
tests a framework's name.
"""

from __future__ import annotations

from memplan.frameworks.common import FrameworkModel, Job


def model(name: str) -> FrameworkModel:
    """The buffer model a strategy row names (Strategy.memory_model)."""
    from memplan.frameworks import ddp, fsdp1, fsdp2, zero3, zero12

    return {"ddp": ddp.MODEL, "zero12": zero12.MODEL, "zero3": zero3.MODEL, "fsdp2": fsdp2.MODEL,
            "fsdp1": fsdp1.MODEL}[name]


__all__ = ["FrameworkModel", "Job", "model"]
