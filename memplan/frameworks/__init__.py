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

from dataclasses import replace
from typing import Any

from memplan.frameworks.common import FrameworkModel, Job


def model(name: str) -> FrameworkModel:
    """The buffer model a strategy row names (Strategy.memory_model)."""
    from memplan.frameworks import ddp, fsdp1, fsdp2, zero3, zero12

    return {"ddp": ddp.MODEL, "zero12": zero12.MODEL, "zero3": zero3.MODEL, "fsdp2": fsdp2.MODEL,
            "fsdp1": fsdp1.MODEL}[name]


def with_unreached(inv: Any, s: Any) -> Any:
    """The inventory as the job trains it where some parameters get no gradient (Settings.unreached): those the
    framework makes no gradient and no optimizer state (FrameworkModel.unreached) not trainable, and marked
    unused (DDP still buckets them); the inventory itself otherwise."""
    if not s.unreached:
        return inv
    how, _ = model(s.strategy.memory_model).unreached(s)
    if how == "trained":
        return inv
    names = set(s.unreached)
    hit = [t.trainable and (t.name in names) for t in inv.tensors]
    if how == "unit":  # a unit's flat parameter gets no gradient only where none of its parameters does
        units: dict[str, list[int]] = {}
        for i, t in enumerate(inv.tensors):
            if t.trainable:
                units.setdefault(t.unit or t.block, []).append(i)
        hit = [False] * len(inv.tensors)
        for idx in units.values():
            if all(inv.tensors[i].name in names for i in idx):
                for i in idx:
                    hit[i] = True
    if not any(hit):
        return inv
    return replace(inv, tensors=tuple(replace(t, trainable=False, unused=True) if h else t
                                      for t, h in zip(inv.tensors, hit)))


__all__ = ["FrameworkModel", "Job", "model", "with_unreached"]
