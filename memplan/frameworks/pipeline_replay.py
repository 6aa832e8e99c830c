"""The reserved-peak replay of a pipeline rank under FSDP2, as torchtitan runs it with torch.distributed.pipelining:
the rank's action list (memplan/parallel/schedules.py, torch's own order) walked one action at a time through the caching
allocator, each stage's traced step split at its forward's end.

What each action does, from torch 2.13's sources:

- setup: torchtitan builds each model part on the meta device, fully_shard-s each block and then the part, and
  materialises the shards (to_empty + init_weights): only the padded fp32 shards are allocated, in module order;
- the first step's receive buffers (stage.py _prepare_forward_infra / _prepare_backward_infra): one buffer per
  micro-batch for the activations a stage after the first receives and one for the gradients a stage before the
  last receives, kept for the run (parallel.recv_buffers: the TP rank's share of the sequence under SP);
- F (forward_one_chunk): the stage's forward events for that micro-batch, keyed by (stage, micro-batch) so that
  its saved tensors live until its B, and its output kept in fwd_cache until then (the traced step lets it go
  where the model returns: parallel.stage_output's bytes held instead); each block unshards at its first forward
  of the step and stays unsharded (torchtitan's apply_fsdp: reshard_after_forward False under PP);
- B (backward_one_chunk -> backward_maybe_with_nosync): the rest of the stage's events; FSDP2 runs with
  set_requires_gradient_sync(False) and set_reshard_after_backward(False), so each unit's post_backward
  (_fsdp_param_group.py) neither reduces nor reshards: to_accumulated_grad_if_needed keeps each gradient as an
  unsharded accumulator in the reduce dtype (a new tensor where the dtypes differ, the gradient freed), and a later
  micro-batch's gradient is added into it (accumulate_unsharded_grad_if_needed) and freed;
- after the stage's last backward, REDUCE_GRAD (stage.py perform_reduce_grad): post_backward of every group of the
  part, root first (its _state_ctx.all_states order), now reducing: each group resharded, its reduce-scatter
  input made, its accumulators freed, its output (the sharded gradient) made and kept until zero_grad; the
  previous input held until the next (reduce_scatter_max_input_buffers 1), the last freed by
  _root_post_backward_final_callback;
- the optimizer steps every stage's shards (one optimizer over the rank's model parts).

- a split backward (ZB, ZB-V, DualPipeV's I and W; torch/distributed/pipelining/_backward.py): I runs the
  backward's events without the weight gradients and without freeing what the forward made (stage_backward_input
  retains the graph, which the weight step's intermediates keep alive), and keeps each linear's output gradient
  for W (param_group["grads"]; parallel.zero_bubble_grads' bytes); W makes the weight gradients (accumulated as a
  B's are), then frees the graph's tensors and those gradients. An approximation: which of the graph's tensors
  only the input gradients needed is not known from the traced step (measured within -0.99% .. +6.42%).

Under sequence parallelism the stage's traced step is its TP share over the whole sequence (the events do not have
SP's split, which the engine takes off its own figures), as a TP rank's replay without pipelining is; the replay's
name says so. Not replayed (reserved.why_not says so, and the verdict keeps the flat allocator term for them): DDP
and DeepSpeed under pipelining, CPU offload, LoRA, other FSDP wraps. Also not modelled: torch
2.13's metadata inference at the first step (a real forward and backward of one micro-batch before the schedule
runs, its unsharded parameters and gradients freed after), and _add_unshard_reshard's limit of three unsharded
stages (it reshards only on ranks with more than three stages).

The replay's allocated peak is its own; accounting.estimate stands its allocator overhead on the engine's
allocated peak for the rank (Reserved.moved_to), as it does for a tensor-parallel rank. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memplan.parallel import schedules

#: one event of a traced step, as tracing/segments.py alloc_events makes them (kind first)
Event = tuple[Any, ...]
from memplan.allocator import Allocator, AllocatorConfig
from memplan.frameworks.fsdp2_replay import (
    ROOT,
    RS_STREAM,
    FsdpGroup,
    _MicroStep,
    fsdp_group,
)
from memplan.replay import MAX_STEPS, ReplayJob, Run, micro_step, optimizer_step


def why_not(s: Any) -> str | None:
    """Why this pipeline rank's step cannot be replayed (None: it can)."""
    prof = s.activation_profile
    if not getattr(prof, "actions", None):
        return "pipeline parallelism in the megatron-deepspeed layout (DeepSpeed's PipelineEngine) is not replayed yet"
    if s.strategy.framework != "fsdp2":
        return f"pipeline parallelism under {s.strategy.name}: only FSDP2's pipeline ranks are replayed"
    if s.torch.cpu_offload:
        return "FSDP2 CPU offload under pipelining is not replayed yet"
    if s.torch.fsdp_wrap not in ("block", None, ""):
        return f"--fsdp-wrap {s.torch.fsdp_wrap} under pipelining is not replayed yet"
    if s.lora is not None:
        return "LoRA under pipelining is not replayed"
    if s.torch.reshard_after_forward not in (None, True, False):
        return "reshard_after_forward as a group size under pipelining is not replayed yet"
    for part in prof.stages:
        layers = part.layers
        d = getattr(part.profile, "data", None)
        ev = (d or {}).get("alloc_events")
        if not ev or not ev.get("fs"):
            return "a stage's step was not traced with its allocations (analytic activations)"
        if layers < 1 or (layers < len(ev["fs"]) and not ev.get("expand")):
            return (f"a stage of {layers} block(s): the traced step ({len(ev['fs'])} blocks) has no region to replay "
                    "a stage without blocks" if layers < 1 else
                    f"a stage of {layers} block(s) is smaller than the traced step ({len(ev['fs'])} blocks)")
        if ev.get("forward_end") is None:
            return "a stage's traced step does not mark where its forward returned"
    return None


def _stage_tensors(inv: Any, stages: tuple[Any, ...]) -> list[list[Any]]:
    """Each local stage's tensors, module order: its blocks (the rank's blocks in order, the stages' in turn), the
    embedding with the stage that is the model's first, the final norm and head (a tied head's weight too) with the
    last."""
    from memplan.model.inventory import ROOT_BLOCK

    names = [b.name for b in inv.layer_blocks]
    out: list[list[Any]] = []
    at = 0
    for part in stages:
        first, last = part.first, part.last
        mine = set(names[at:at + part.layers])
        at += part.layers
        ts = []
        for t in inv.tensors:
            if t.block in mine:
                ts.append(t)
            elif t.block == ROOT_BLOCK:
                at_end = t.category in ("head", "norm")
                if (first and not at_end) or (last and (at_end or t.tied_names)):
                    ts.append(t)
        out.append(ts)
    return out


class _Stage(_MicroStep):
    """One model part of the rank under FSDP2 through a pipeline step: its units unsharded at their first forward
    and kept, each micro-batch's gradients accumulated unsharded, reduced once at REDUCE_GRAD."""

    def __init__(self, run: Run, job: ReplayJob, blocks: tuple[FsdpGroup, ...], root: FsdpGroup, world: int,
                 reduce_bytes: int, grad_bytes: int, sharded_grads: list[Any], reshard_after_forward: bool) -> None:
        super().__init__(run, job, blocks, root, world, reshard_after_forward, sharded_grads, first=False,
                         keep=True)
        self.reduce_bytes, self.grad_bytes = reduce_bytes, grad_bytes
        self.acc: dict[int, list[Any]] = {}  #: each unit's unsharded accumulators, in its gradients' order
        self.sizes: dict[Any, int] = {}
        self.started = False  #: the step's first forward has run (the root unsharded)

    def begin_forward(self) -> None:
        self.kind, self.forward, self.returned, self.bwd = "", None, False, None
        if not self.started:
            self.started = True
            self.unshard(ROOT, hold=True)

    def begin_backward(self) -> None:
        self.kind, self.forward, self.returned, self.bwd = "mid", None, True, None

    def on_grad(self, size: int, key: Any, blk: int) -> bool:
        self.sizes[key] = size
        self.grads_of.setdefault(self.unit_of(blk), []).append(key)
        return True  # kept past its traced death: the unit's post-backward decides

    input_only = False  #: an input-gradient step (I): no weight gradients yet, nothing to accumulate

    def weight_step(self, births: list[tuple[int, int]]) -> None:
        """W (stage_backward_weight): the weight gradients made, in the backward's order, then each unit's
        accumulation as its post-backward does it."""
        order: list[int] = []
        for size, blk in births:
            key = self.run.alloc(size)
            unit = self.unit_of(blk)
            self.sizes[key] = size
            self.grads_of.setdefault(unit, []).append(key)
            if unit not in order:
                order.append(unit)
        for unit in order:
            self.post_backward(unit)

    def post_backward(self, i: int) -> None:
        """No gradient sync: each gradient kept as (or added into) the unit's unsharded accumulator."""
        if self.input_only:
            return
        run = self.run
        for k in self.held:
            run.free(k)
        self.held.clear()
        grads = self.grads_of.pop(i, [])
        acc = self.acc.get(i)
        if acc is None:
            keep = []
            for k in grads:
                if self.reduce_bytes != self.grad_bytes:  # to_accumulated_grad_if_needed: .to(reduce_dtype)
                    keep.append(run.alloc(self.sizes[k] // self.grad_bytes * self.reduce_bytes))
                    run.free(k)
                else:
                    keep.append(k)  # the gradient itself stays; later ones are added into it
            self.acc[i] = keep
        else:
            for k in grads:
                run.free(k)

    def end_backward(self) -> None:
        if self.bwd is not None:
            self.post_backward(self.bwd)
            self.bwd = None
        self.post_backward(ROOT)

    def reduce(self) -> None:
        """REDUCE_GRAD: every group's post_backward with the sync on, the root's first."""
        run = self.run
        for i in [ROOT, *range(len(self.blocks))]:
            g = self.units[i]
            for k in self.unsharded.pop(i, []):  # reshard
                run.free(k)
            acc = self.acc.pop(i, [])
            if not g.params or not g.reduce_in or not acc:
                continue
            rs_in = run.alloc(g.reduce_in)
            for k in acc:
                run.free(k)
            for k in self.held:
                run.free(k)
            self.held.clear()
            self.outputs.append(run.alloc(g.reduce_out, stream=RS_STREAM))
            if self.flat:
                self.held.append(rs_in)
            else:
                run.free(rs_in)
        for k in self.held:  # _root_post_backward_final_callback
            run.free(k)
        self.held.clear()
        self.started = False


def _input_only(fwd: list[Event], bwd: list[Event], micro_batch: int) -> tuple[list[Event], list[Any],
                                                                              list[tuple[int, int]]]:
    """A split backward's input step (stage_backward_input, the graph retained for the weight step): the backward's
    events without its weight gradients, and without freeing what the forward made (the saved tensors stay with
    the graph until W); (those events, the forward's keys freed at W, each weight gradient's (bytes, block) for
    W in the order the backward makes them)."""
    made = {e[1] for e in fwd if e[0] == "a"}
    grads = {e[1] for e in bwd if e[0] == "a" and e[3] is not None}
    events = [e for e in bwd if not (e[0] == "a" and e[3] is not None)
              and not (e[0] == "f" and (e[1] in made or e[1] in grads))]
    deferred = [e[1] for e in bwd if e[0] == "f" and e[1] in made]
    births = [(e[2][0] + e[2][1] * micro_batch, e[3]) for e in bwd if e[0] == "a" and e[3] is not None]
    return events, deferred, births


def _split(step: list[Event]) -> tuple[list[Event], list[Event]]:
    """A traced step's forward (through the model's return, the loss included) and its backward."""
    at = next(i for i, e in enumerate(step) if e[0] == "m" and e[1] == "fwd_end")
    return step[:at + 1], step[at + 1:]


def replay(inv: Any, s: Any, config: AllocatorConfig) -> tuple[str, dict[str, Allocator]]:
    from memplan.frameworks.common import Job
    from memplan.frameworks.fsdp2 import MODEL, reshard_after_forward, unshard_bytes
    from memplan.replay import replay_job
    from memplan.settings import shard_group_size

    prof = s.activation_profile
    rs = prof.actions
    schedule, pp, m, per_rank, rank = rs.schedule, rs.pp, rs.micro_batches, rs.per_rank, rs.rank
    # False unless the job asks for it (torchtitan's default under PP); a group size is not replayed (why_not)
    raf = reshard_after_forward(Job.of(inv, s, MODEL)) is True
    n, r = shard_group_size(s), s.recipe
    cb = unshard_bytes(r)
    position = {t.name: i for i, t in enumerate(inv.tensors)}

    def group(ts: list[Any]) -> FsdpGroup:
        return fsdp_group(ts, position, n, r, cb)

    from memplan.model.inventory import ROOT_BLOCK

    parts = []  # per local stage: (its job, forward events, backward events, block groups, root group)
    numels: list[tuple[int, int]] = []
    for part, ts in zip(prof.stages, _stage_tensors(inv, prof.stages)):
        blocks: dict[str, list[Any]] = {}
        root: list[Any] = []
        for t in ts:
            (root if t.block == ROOT_BLOCK else blocks.setdefault(t.block, [])).append(t)
        block_groups = tuple(group(b) for b in blocks.values())
        root_group = group(root)
        for g in (*block_groups, root_group):
            numels.extend((i, p // n) for i, p in zip(g.params, g.padded))
        job = replay_job(inv, replace(s, activation_profile=part.profile, grad_accum=1), [])
        fwd, bwd = _split(job.step)
        split = _input_only(fwd, bwd, s.micro_batch) if schedule in schedules.SPLIT_BACKWARD else None
        parts.append((job, fwd, bwd, block_groups, root_group, split))
    numels.sort()
    opt_job = replay_job(inv, replace(s, activation_profile=prof.stages[0].profile, grad_accum=1), [k for _, k in numels])

    run = Run(config or AllocatorConfig(), opt_job.buffers)
    for _, _, _, bg, rg, _ in parts:  # to_empty: the shards in module order
        for i in sorted(i for g in (*bg, rg) for i in g.params):
            for g in (*bg, rg):
                if i in g.params:
                    run.alloc(g.shard[g.params.index(i)])
    # the receive buffers, each [micro-batch, the rank's tokens, hidden] (parallel.recv_buffers' sizes)
    each, count = rs.recv_bytes * s.micro_batch, rs.recv_count
    actions = schedules.rank_actions(schedule, pp, m, per_rank, rank)
    local = {g: k for k, g in enumerate(schedules.rank_stages(schedule, pp, per_rank)[rank])}
    last_backward = {}  # each stage's last B or W: its REDUCE_GRAD follows (_add_reduce_grad)
    for idx, (stage, kind, _) in enumerate(actions):
        if kind in (schedules.B, schedules.W):
            last_backward[local[stage]] = idx
    states: list[Any] = []
    for step in range(MAX_STEPS):
        before = run.a.peak_reserved
        if step == 0:  # _prepare_forward_infra / _prepare_backward_infra at the first step, kept for the run
            for _ in range(count):
                run.alloc(each)
        grads: list[Any] = []
        stages = [_Stage(run, job, bg, rg, n, r.reduced_grad_bytes, r.grad_bytes, grads, raf)
                  for job, _, _, bg, rg, _ in parts]
        # the step's batch on the first stage (split into micro-batch views) and its targets on the last
        ids = [run.alloc(opt_job.input_bytes * m) for on in (any(x.first for x in prof.stages),
                                                             any(x.last for x in prof.stages)) if on]
        offsets: dict[tuple[int, int], int] = {}
        cached: dict[tuple[int, int], Any] = {}
        held_for_w: dict[tuple[int, int], list[Any]] = {}
        for idx, (stage, kind, mb) in enumerate(actions):
            c = local[stage]
            job, fwd, bwd, _, _, split = parts[c]
            st = stages[c]
            if kind == schedules.F:
                offsets[c, mb] = run.offset()
                st.begin_forward()
                micro_step(run, job, keep_grads=False, at=st.region, on_grad=st.on_grad,
                           on_forward_end=st.forward_returned, events=fwd, off=offsets[c, mb])
                # forward_one_chunk keeps the stage's output in fwd_cache until the micro-batch's backward (the
                # traced step lets go of it where the model returns: the last block's output, or the logits)
                if prof.stages[c].output_bytes:
                    cached[c, mb] = run.alloc(prof.stages[c].output_bytes * s.micro_batch)
            elif kind == schedules.W:
                assert split is not None  # a schedule with weight steps splits every backward
                # stage_backward_weight: the weight gradients, then the graph's saved tensors and the gradients
                # the input step kept for it go
                st.weight_step(split[2])
                for k in held_for_w.pop((c, mb)):
                    run.free(k)
                if last_backward.get(c) == idx:
                    st.reduce()
            else:
                if (c, mb) in cached:
                    run.free(cached.pop((c, mb)))
                st.begin_backward()
                off = offsets.pop((c, mb))
                if kind == schedules.I:
                    assert split is not None
                    st.input_only = True
                    micro_step(run, job, keep_grads=False, at=st.region, on_grad=st.on_grad,
                               on_forward_end=None, events=split[0], off=off)
                    st.input_only = False
                    st.bwd = None
                    # param_group["grads"]: each linear's output gradient, kept for W (parallel.zero_bubble_grads)
                    kept = prof.stages[c].kept_for_w
                    keep = [run.alloc(kept * s.micro_batch)] if kept else []
                    held_for_w[c, mb] = [off + k for k in split[1]] + keep
                    continue
                micro_step(run, job, keep_grads=True, at=st.region, on_grad=st.on_grad,
                           on_forward_end=None, events=bwd, off=off)
                st.end_backward()
                if last_backward.get(c) == idx:
                    st.reduce()
        for k in ids:
            run.free(k)
        optimizer_step(run, opt_job, step == 0, states)
        for k in grads:  # zero_grad(set_to_none)
            run.free(k)
        run.end_step()
        if step >= 1 and run.a.peak_reserved == before:
            break
    name = "FSDP2 under " + schedules.TORCH_NAMES[schedule]
    if rs.sequence_parallel:
        # sequence parallelism: the stage's traced step is its TP share over the whole sequence (the engine takes
        # SP's split off its own figures, the events do not have it), as a TP rank's replay without pipelining is
        # (reserved._replayed_profile); its allocator overhead stands on the engine's allocated peak
        name += ", the TP share's step without SP's split"
    return name, {"": run.a}
