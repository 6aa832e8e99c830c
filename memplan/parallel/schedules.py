"""Pipeline schedules as torch.distributed.pipelining runs them: each rank's list of compute actions.

A pipeline rank's memory at any moment depends on which micro-batches of which of its stages have run their
forward and not yet their backward. torch decides that with an action list per rank (``pipeline_order``), built by
each schedule class; this module builds the same lists in pure Python (no torch import on the fast path), ported
from torch 2.13's torch/distributed/pipelining/schedules.py, and tests/parallel/test_pipeline_schedules.py checks them
against torch's own (``_schedule_visualizer.get_schedule_ops``) over a grid of ranks, micro-batches and stages:

- ``gpipe``: ScheduleGPipe, every forward then every backward (its _step_microbatches loop; _get_pipeline_order);
- ``1f1b``: Schedule1F1B, min(m, pp - rank) forwards, then one backward and one forward until the forwards run
  out (_get_pipeline_order: pp - 1 - rank forwards, then forward-backward pairs);
- ``interleaved``: ScheduleInterleaved1F1B, several stages per rank in a loop (rank r runs stages r, r + pp, ...),
  _get_1f1b_rank_ops with _get_warmup_ops(multiply_factor=2);
- ``looped-bfs``: ScheduleLoopedBFS, every micro-batch of each local stage in turn, then the backwards in reverse;
- ``interleaved-zb``: ScheduleInterleavedZeroBubble (ZB1P), the interleaved order with each backward split into
  its input-gradient step (I) and its weight-gradient step (W) deferred by ``rank`` micro-batches;
- ``zbv``: ScheduleZBVZeroBubble, two stages per rank in a V (rank r runs stages r and 2 pp - 1 - r);
- ``dualpipev``: ScheduleDualPipeV (DeepSeek's DualPipe as a V), with forward-and-backward pairs
  (OVERLAP_F_B, whose two sub-actions the runtime runs one after the other: _PipelineScheduleRuntime._step_microbatches).

An action is (stage index, kind, micro-batch), kind one of F (forward), B (full backward), I (backward of the
inputs only: stage_backward_input keeps the graph for W), W (backward of the weights). Bubbles (None) are dropped;
an OVERLAP_F_B is its two sub-actions in order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from memplan.errors import SettingsError

F, B, I, W = "F", "B", "I", "W"
#: one compute action: (stage, kind F | B | I | W, micro-batch)
Action = tuple[int, str, int]

#: memplan's schedule names -> torch's class names (get_schedule_class), which --schedule also takes
TORCH_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "looped-bfs": "LoopedBFS",
               "interleaved-zb": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
#: schedules that run more than one stage per rank (PipelineScheduleMulti)
MULTI_STAGE = frozenset({"interleaved", "looped-bfs", "interleaved-zb", "zbv", "dualpipev"})
#: ... with the stages placed in a V (generate_stage_to_rank_mapping style "v"), exactly two per rank
V_SHAPED = frozenset({"zbv", "dualpipev"})
#: schedules whose backwards are split into I and W
SPLIT_BACKWARD = frozenset({"interleaved-zb", "zbv", "dualpipev"})


@dataclass(frozen=True)
class StagePart:
    """One local stage of a pipeline rank, as its replay walks it (frameworks/pipeline_replay.py)."""

    profile: Any  #: the stage's traced step (its blocks, and the loss where it is the last)
    layers: int  #: its blocks
    first: bool  #: it holds the embedding
    last: bool  #: it holds the final norm and the head
    output_bytes: int  #: per micro-batch of 1, the output fwd_cache keeps until its backward (parallel.stage_output)
    kept_for_w: int  #: per micro-batch of 1, what a split backward's input step keeps for W (zero_bubble_grads)


@dataclass(frozen=True)
class RankSchedule:
    """A pipeline rank's schedule and what its replay needs beside its stages."""

    schedule: str
    pp: int
    micro_batches: int
    per_rank: int  #: stages per rank
    rank: int
    recv_bytes: int  #: one receive buffer per micro-batch of 1 (parallel.recv_buffers)
    recv_count: int  #: receive buffers the rank makes at its first step
    sequence_parallel: bool  #: its stages' traced steps are the TP share's over the whole sequence
    #: who runs the schedule: torchtitan (torch.distributed.pipelining) or megatron-deepspeed (DeepSpeed's
    #: PipelineEngine, frameworks/pipe_engine_replay.py)
    layout: str = "torchtitan"
    tp: int = 1  #: tensor-parallel ranks of the stage


def canonical(name: str) -> str | None:
    """memplan's name for a schedule given by its own or torch's name (case-insensitive); None if unknown."""
    low = name.lower()
    for ours, theirs in TORCH_NAMES.items():
        if low in (ours, theirs.lower()):
            return ours
    return {"zero-bubble": "zbv", "looped_bfs": "looped-bfs", "interleaved_zb": "interleaved-zb"}.get(low)


def rank_stages(schedule: str, pp: int, per_rank: int) -> list[tuple[int, ...]]:
    """Each rank's global stage indices in local order (torch's generate_rank_to_stage_mapping: "loop" r, r + pp,
    ...; "v" for the V schedules: r and 2 pp - 1 - r)."""
    if schedule in V_SHAPED:
        return [(r, 2 * pp - 1 - r) for r in range(pp)]
    return [tuple(r + k * pp for k in range(per_rank)) for r in range(pp)]


def check(schedule: str, pp: int, micro_batches: int, per_rank: int) -> None:
    """The rules torch's schedule classes enforce in their constructors (SettingsError naming the rule)."""
    stages = pp * per_rank
    if schedule == "1f1b" and micro_batches < pp:
        raise SettingsError(f"--grad-accum {micro_batches} micro-batches with --schedule 1f1b over {pp} stages: "
                            "torch's Schedule1F1B needs at least as many micro-batches as stages")
    if schedule in ("interleaved", "interleaved-zb"):
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            raise SettingsError(f"--grad-accum {micro_batches} micro-batches: torch's {TORCH_NAMES[schedule]} needs a "
                                f"multiple of its rounds ({rounds} = max(1, micro-batches // pp))")
    if schedule in V_SHAPED and per_rank != 2:
        raise SettingsError(f"--vpp {per_rank} with --schedule {schedule}: {TORCH_NAMES[schedule]} runs exactly two "
                            "stages per rank")
    if schedule == "dualpipev" and micro_batches < stages:
        raise SettingsError(f"--grad-accum {micro_batches} micro-batches with --schedule dualpipev: torch's DualPipeV "
                            f"needs at least as many micro-batches as stages ({stages})")


@lru_cache(maxsize=512)
def rank_actions(schedule: str, pp: int, micro_batches: int, per_rank: int, rank: int) -> tuple[Action, ...]:
    """Rank ``rank``'s compute actions in the order it runs them: (stage, kind, micro-batch) each."""
    m = micro_batches
    if schedule == "gpipe":
        ops = [(rank, F, i) for i in range(m)] + [(rank, B, i) for i in range(m)]
    elif schedule == "1f1b":
        ops = _one_f_one_b(pp, m, rank)
    elif schedule == "looped-bfs":
        stages = range(rank, pp * per_rank, pp)
        ops = [(s, F, i) for s in stages for i in range(m)]
        ops += [(s, B, i) for s in reversed(stages) for i in reversed(range(m))]
    elif schedule in ("interleaved", "interleaved-zb"):
        ops = _interleaved(pp, m, per_rank, rank, schedule == "interleaved-zb")
    elif schedule == "zbv":
        ops = _zbv(pp, m, rank)
    elif schedule == "dualpipev":
        ops = _dualpipev(pp, m, rank)
    else:
        raise SettingsError(f"unknown pipeline schedule {schedule!r}")
    return tuple(ops)


def _one_f_one_b(pp: int, m: int, rank: int) -> list[Action]:
    """Schedule1F1B._get_pipeline_order (the order its _step_microbatches runs)."""
    ops = []
    warm = min(pp - 1 - rank, m)  # torch refuses fewer micro-batches than stages; DeepSpeed's TrainSchedule not
    for i in range(warm):
        ops.append((rank, F, i))
    f, b = warm, 0
    while f < m:
        ops += [(rank, F, f), (rank, B, b)]
        f += 1
        b += 1
    ops += [(rank, B, i) for i in range(b, m)]
    return ops


def _interleaved(pp: int, m: int, v: int, rank: int, zero_bubble: bool) -> list[Action]:
    """ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble._calculate_single_rank_operations
    (_get_warmup_ops, _get_1f1b_rank_ops)."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
    total = m * v

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * pp + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warm) // per_round) % v) * pp + rank

    fc: dict[int, int] = defaultdict(int)
    bc: dict[int, int] = defaultdict(int)
    wc: dict[int, int] = defaultdict(int)
    ops: list[Action] = []
    backward_ids: list[int] = []
    weights = 0
    kind = I if zero_bubble else B

    def weight() -> None:
        nonlocal weights
        s = bwd_stage(backward_ids[weights])
        ops.append((s, W, wc[s]))
        wc[s] += 1
        weights += 1

    for op in range(total + warm):  # torch's warm-up + 1F1B + cooldown ops
        if op < warm:
            s = fwd_stage(op)
            ops.append((s, F, fc[s]))
            fc[s] += 1
            continue
        if op < total:
            s = fwd_stage(op)
            ops.append((s, F, fc[s]))
            fc[s] += 1
        s = bwd_stage(op)
        ops.append((s, kind, bc[s]))
        bc[s] += 1
        backward_ids.append(op)
        if zero_bubble and op - warm >= rank:
            weight()
    while zero_bubble and weights < len(backward_ids):
        weight()
    return ops


def _zbv(pp: int, m: int, rank: int) -> list[Action]:
    """ScheduleZBVZeroBubble._calculate_single_rank_operations (micro-batches past the real ones dropped)."""
    n = max(2 * pp - 1, m)
    s0, s1 = rank, 2 * pp - 1 - rank
    ops: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - rank) - 1):
        ops.append((s0, F, f0))
        f0 += 1
    for _ in range(rank):
        ops += [(s1, F, f1), (s0, F, f0)]
        f1 += 1
        f0 += 1
    for _ in range(pp - rank):
        ops += [(s1, F, f1), (s1, I, b1), (s1, W, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append((s0, F, f0))
            f0 += 1
        ops += [(s0, I, b0), (s0, W, b0), (s1, F, f1), (s1, I, b1), (s1, W, b1)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [(s0, I, b0), (s1, I, b1)]
        b0 += 1
        b1 += 1
    for _ in range(pp - rank):
        ops += [(s0, I, b0), (s0, W, w0)]
        b0 += 1
        w0 += 1
    ops += [(s1, W, i) for i in range(w1, b1)] + [(s0, W, i) for i in range(w0, b0)]
    return [a for a in ops if a[2] < m]


def _dualpipev(pp: int, m: int, rank: int) -> list[Action]:
    """ScheduleDualPipeV._calculate_single_rank_operations, each OVERLAP_F_B as its forward then its full
    backward."""
    s0, s1 = rank, 2 * pp - 1 - rank
    count: dict[tuple[int, str], int] = {}
    queue: list[tuple[int, int]] = []
    ops: list[Action] = []

    def add(stage: int, kind: str) -> None:
        key = (stage, I if kind == B else kind)
        mb = count.get(key, 0)
        ops.append((stage, kind, mb))
        if kind == B:
            count[stage, I] = mb + 1
            count[stage, W] = count.get((stage, W), 0) + 1
        else:
            if kind == I:
                queue.append((stage, mb))
            count[key] = mb + 1

    def weight() -> None:
        if queue:
            stage, mb = queue.pop(0)
            ops.append((stage, W, mb))
            count[stage, W] = count.get((stage, W), 0) + 1

    def overlap(fwd: int, bwd: int) -> None:
        add(fwd, F)
        add(bwd, B)

    for _ in range((pp - rank - 1) * 2):
        add(s0, F)
    for _ in range(rank + 1):
        add(s0, F)
        add(s1, F)
    for _ in range(pp - rank - 1):
        add(s1, I)
        weight()
        add(s1, F)
    for i in range(m - pp * 2 + rank + 1):
        if i == 0 and rank == pp - 1:
            add(s0, F)
            add(s1, B)
        else:
            overlap(s0, s1)
        overlap(s1, s0)
    for _ in range(pp - rank - 1):
        add(s1, B)
        overlap(s1, s0)
    zb = False
    steps = rank + 1
    for i in range(steps):
        if i == steps // 2 and rank % 2 == 1:
            zb = True
        add(s1, I if zb else B)
        if i == steps // 2 and rank % 2 == 0:
            zb = True
        add(s0, I if zb else B)
    for _ in range(pp - rank - 1):
        weight()
        add(s0, I if zb else B)
    for _ in range(rank + 1):
        weight()
    return ops


def held_moments(schedule: str, pp: int, micro_batches: int, per_rank: int, rank: int
                 ) -> list[tuple[tuple[int, ...], int, str]]:
    """Each backward (B or I) of a rank, in order: (micro-batches whose activations each local stage holds, the one
    about to run its backward included; the local stage it runs on; its kind). A micro-batch is held from its
    forward until its full backward, or until its weight-gradient step (W) where the backward is split: the input
    step keeps the graph for it (torch/distributed/pipelining/_backward.py stage_backward_input)."""
    return [m[:3] for m in backward_moments(schedule, pp, micro_batches, per_rank, rank)]


def backward_moments(schedule: str, pp: int, micro_batches: int, per_rank: int, rank: int
                     ) -> list[tuple[tuple[int, ...], int, str, tuple[bool, ...]]]:
    """held_moments, each with the local stages whose weight gradients are accumulated before it: those that ran a
    full backward (B) or a weight-gradient step (W) already (FSDP2 under pipelining keeps each group's unsharded
    accumulators from its first post-backward to REDUCE_GRAD)."""
    local = {s: k for k, s in enumerate(rank_stages(schedule, pp, per_rank)[rank])}
    held = [0] * len(local)
    done = [False] * len(local)
    out = []
    for stage, kind, _ in rank_actions(schedule, pp, micro_batches, per_rank, rank):
        c = local[stage]
        if kind == F:
            held[c] += 1
        elif kind in (B, I):
            out.append((tuple(held), c, kind, tuple(done)))
            if kind == B:
                held[c] -= 1
                done[c] = True
        else:
            held[c] -= 1
            done[c] = True
    return out
