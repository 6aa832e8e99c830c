"""The reserved-peak replay of a pipeline rank under FSDP2 (or DDP: _DdpStage), as torchtitan runs it with
torch.distributed.pipelining:
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
  only the input gradients needed is not known from the traced step (measured within -2.89% .. +3.28%).

Under sequence parallelism the stage's traced step is its TP share over the whole sequence (the events do not have
SP's split, which the engine takes off its own figures), as a TP rank's replay without pipelining is; the replay's
name says so. Each stage's traced step is a whole model's (the last stage's with the loss, the others' with a
vocabulary of parallel.BARE_VOCAB rows): _parts keeps what the stage runs (_own_root_grads, _without_births) and
shares autocast's weight casts over the schedule step (_weight_casts). DeepSpeed's PipelineEngine walks its own
TrainSchedule (pipe_engine_replay.py, dispatched from here). Not replayed (reserved.why_not says so, and the figures
are then bounds from below): FSDP2's CPU offload, other FSDP wraps, a reshard group size (LoRA with --pp is refused
at input). Also not modelled: torch
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
    EXPERT_KINDS,
    ROOT,
    RS_STREAM,
    XOFF,
    FsdpGroup,
    _MicroStep,
    fsdp_group,
)
from memplan.replay import MAX_STEPS, ReplayJob, Run, micro_step, optimizer_step


def why_not(s: Any) -> str | None:
    """Why this pipeline rank's step cannot be replayed (None: it can)."""
    prof = s.activation_profile
    if not getattr(prof, "actions", None):
        return "the rank's schedule was not laid out"
    if prof.actions.layout != "torchtitan":
        from memplan.frameworks import pipe_engine_replay

        why = pipe_engine_replay.why_not(s)
        return why if why is not None else _stages_traced(prof)
    if s.strategy.framework != "fsdp2" and s.strategy.name != "ddp":
        return f"pipeline parallelism under {s.strategy.name}: only FSDP2's and DDP's pipeline ranks are replayed"
    if s.torch.cpu_offload:
        return "FSDP2 CPU offload under pipelining is not replayed yet"
    if s.torch.fsdp_wrap not in ("block", None, ""):
        return f"--fsdp-wrap {s.torch.fsdp_wrap} under pipelining is not replayed yet"
    if s.torch.reshard_after_forward not in (None, True, False):
        return "reshard_after_forward as a group size under pipelining is not replayed yet"
    return _stages_traced(prof)


def _stages_traced(prof: Any) -> str | None:
    """Why a stage's traced step cannot be replayed (None: each can)."""
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


def stage_tensors(inv: Any, stages: tuple[Any, ...]) -> list[list[Any]]:
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
                 reduce_bytes: int, grad_bytes: int, sharded_grads: list[Any], reshard_after_forward: bool,
                 experts: dict[int, FsdpGroup], experts_world: int) -> None:
        super().__init__(run, job, blocks, root, world, reshard_after_forward, sharded_grads, first=False,
                         keep=True)
        for i, g in experts.items():  # expert parallelism: each block's experts module, a unit of its own
            self.units[XOFF + i] = g
            self.worlds[XOFF + i] = experts_world
        self.reduce_bytes, self.grad_bytes = reduce_bytes, grad_bytes
        self.acc: dict[int, list[Any]] = {}  #: each unit's unsharded accumulators, in its gradients' order
        self.sizes: dict[Any, int] = {}
        self.started = False  #: the step's first forward has run (the root unsharded)
        self.cpu_cast = False  #: the CPU harness's device (its promoting temporaries; see post_backward)

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
        # both loops go over FSDPParamGroup.fsdp_params, in module order; autograd made the unit's gradients in
        # about the reverse of it (the last module's first)
        grads = self.grads_of.pop(i, [])[::-1]
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
                if self.cpu_cast and self.reduce_bytes != self.grad_bytes:
                    # accumulate_unsharded_grad_if_needed's ``acc += grad`` across dtypes: on the CPU,
                    # TensorIterator's compute_types promotes the input through a temporary of the common dtype
                    # (CUDA's kernels cast as they load: none there); one gradient's, made and freed before it goes
                    run.free(run.alloc(self.sizes[k] // self.grad_bytes * self.reduce_bytes))
                run.free(k)

    def end_backward(self) -> None:
        if self.bwd is not None:
            self.post_backward(self.bwd)
            self.bwd = None
        self.post_backward(ROOT)

    def reduce(self) -> None:
        """REDUCE_GRAD: every group's post_backward with the sync on, in _state_ctx.all_states order (the part's
        named_modules: the root, then each block followed by its experts module)."""
        run = self.run
        for i in [ROOT, *(u for b in range(len(self.blocks)) for u in (b, XOFF + b) if u in self.units)]:
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


def _own_root_grads(bwd: list[Event], part: Any, ts: list[Any]) -> list[Event]:
    """A stage's backward with the gradients of the parameters outside the blocks that the stage holds. Its traced
    step is a whole model's (accounting.Layout: the last stage's with the head and the loss, the others' with a
    vocabulary of parallel.BARE_VOCAB rows), so its backward runs the loss's, the head's and the final norm's
    before the blocks' (the "B" regions) and the embedding's after them (the "post" region). A stage without the
    head starts at its last block's (the gradient of its output is a receive buffer); a stage without the
    embedding runs no embedding backward after (what those parts allocate dropped: their frees then find
    nothing); the first stage's embedding gradient, traced with
    BARE_VOCAB rows, is its real embedding's (its rows x width at the traced bytes per element)."""
    from memplan.parallel.tensor import BARE_VOCAB

    if part.first and part.last:
        return bwd
    widths = {t.shape[1]: t.shape[0] for t in ts if t.category == "embedding" and len(t.shape) == 2} \
        if part.first and not part.last else {}
    out: list[Event] = []
    region = "head"
    for e in bwd:
        if e[0] == "m" and e[1] == "B":
            region = "blocks"
        elif e[0] == "m" and e[1] == "post":
            region = "post"
        if e[0] == "a":
            grad = e[5] is None and e[3] is not None and e[3] < 0
            if region == "head" and not part.last:
                continue  # the loss's, the head's and the final norm's backward run on the last stage only
            if region == "post" and not part.first:
                continue
            if region == "post" and grad and widths:
                c0, c1 = e[2]
                if not c1:
                    for width, rows in widths.items():
                        per = BARE_VOCAB * width
                        if c0 % per == 0 and c0 // per in (1, 2, 4, 8):
                            e = (*e[:2], (c0 // BARE_VOCAB * rows, 0), *e[3:])
                            break
        out.append(e)
    return out


def _split(step: list[Event]) -> tuple[list[Event], list[Event]]:
    """A traced step's forward (through the model's return, the loss included) and its backward."""
    at = next(i for i, e in enumerate(step) if e[0] == "m" and e[1] == "fwd_end")
    return step[:at + 1], step[at + 1:]


def replay(inv: Any, s: Any, config: AllocatorConfig) -> tuple[str, dict[str, Allocator]]:
    prof = s.activation_profile
    if prof.actions.layout != "torchtitan":
        from memplan.frameworks import pipe_engine_replay

        return pipe_engine_replay.replay(inv, s, config, _parts(inv, s)[0])
    name = (" under " + schedules.TORCH_NAMES[prof.actions.schedule]
            + (", the TP share's step without SP's split" if prof.actions.sequence_parallel else ""))
    # under sequence parallelism the stage's traced step is its TP share over the whole sequence (the engine takes
    # SP's split off its own figures, the events do not have it), as a TP rank's replay without pipelining is
    # (reserved._replayed_profile); its allocator overhead stands on the engine's allocated peak
    if s.strategy.framework == "torch-ddp":
        view = s.torch.gradient_as_bucket_view
        return "DDP" + (", gradients as bucket views," if view else "") + name, {
            "buckets released at the rebuild": _replay_ddp(inv, s, config, "pre"),
            "buckets held into the next backward": _replay_ddp(inv, s, config, "grad")}
    return "FSDP2" + name, {"": _replay_fsdp2(inv, s, config)}


class _Part:
    """One local stage as the walk replays it: its job, its traced step's forward (``first``: the step's first
    micro-batch's, which makes autocast's weight casts; ``later``: the others', which find them cached) and
    backward, a split backward's input step (_input_only) where the schedule splits it, and the casts' keys."""

    __slots__ = ("job", "first", "later", "bwd", "split", "casts")

    def __init__(self, job: Any, first: list[Event], later: list[Event], bwd: list[Event], split: Any,
                 casts: list[Any]) -> None:
        self.job, self.first, self.later, self.bwd, self.split, self.casts = job, first, later, bwd, split, casts


def _parts(inv: Any, s: Any) -> list[_Part]:
    """Each local stage's _Part."""
    from memplan.replay import replay_job

    prof = s.activation_profile
    out = []
    for part, ts in zip(prof.stages, stage_tensors(inv, prof.stages)):
        job = replay_job(inv, replace(s, activation_profile=part.profile, grad_accum=1), [])
        fwd, bwd = _split(job.step)
        bwd = _own_root_grads(bwd, part, ts)
        if not part.last:
            # a stage without the head returns its last block's output: the traced model's final norm, head and
            # loss (parallel.BARE_VOCAB rows) run on no stage of it (accounting.Layout takes the norm's saved
            # bytes off the engine's figure alike)
            fwd = _without_births(fwd, "mid")
        casts = _weight_casts(fwd, s, part, ts)
        later = fwd
        if casts:
            # one autocast region over the whole schedule step (torchtitan's maybe_enable_amp around
            # pp_schedule.step): autocast_mode.cpp cached_cast keeps each weight's cast from its first use until
            # the region exits, so the step's first forward of the stage makes them and they live to the step's
            # end; the later micro-batches' forwards (and backwards) find them cached (accounting.Layout's
            # ``shared`` term, the engine's side of the same)
            fwd = [e for e in fwd if not (e[0] == "f" and e[1] in casts)]
            later = [e for e in fwd if not (e[0] == "a" and e[1] in casts)]
            bwd = [e for e in bwd if not (e[0] == "f" and e[1] in casts)]
        split = _input_only(fwd, bwd, s.micro_batch) if prof.actions.schedule in schedules.SPLIT_BACKWARD else None
        out.append(_Part(job, fwd, later, bwd, split, sorted(casts)))
    return out


def _without_births(events: list[Event], region: str) -> list[Event]:
    """``events`` without the allocations of one region ("mid": after the last block's forward; its frees then
    find nothing)."""
    out: list[Event] = []
    at = ""
    for e in events:
        if e[0] == "m" and e[1] != "ws" and e[1] not in EXPERT_KINDS:
            at = e[1]
        if not (e[0] == "a" and at == region):
            out.append(e)
    return out


def _weight_casts(fwd: list[Event], s: Any, part: Any, ts: list[Any]) -> set[Any]:
    """The births of a stage's forward that are autocast's casts of its weights (torch.autocast over fp32
    parameters): in the blocks' forward and the head's, constant in the micro-batch, each the size of one of the
    stage's matrices at the compute dtype (the embedding's is never cast: embedding runs outside autocast's
    lists), taken in turn. Empty where the recipe casts nothing or the traced step has no casts."""
    from collections import Counter

    rc = s.recipe
    if not rc.autocast_weight_copies or not part.profile.includes_autocast_copies:
        return set()
    left = Counter(t.numel * rc.compute_bytes for t in ts
                   if len(t.shape) >= 2 and (t.category != "embedding" or t.tied_names))
    out: set[Any] = set()
    region = ""
    for e in fwd:
        if e[0] == "m" and e[1] != "ws" and e[1] not in EXPERT_KINDS:  # an experts module's marks: inside a block
            region = e[1]
        elif e[0] == "a" and region in ("F", "mid") and e[3] is None and e[5] is None and not e[2][1]:
            if left[e[2][0]] > 0:
                left[e[2][0]] -= 1
                out.add(e[1])
    return out


def _replay_fsdp2(inv: Any, s: Any, config: AllocatorConfig) -> Allocator:
    from memplan.frameworks.common import Job
    from memplan.frameworks.fsdp2 import MODEL, reshard_after_forward, unshard_bytes
    from memplan.layouts import tensor_group
    from memplan.model.inventory import ROOT_BLOCK
    from memplan.replay import replay_job
    from memplan.settings import shard_group_size

    prof = s.activation_profile
    # False unless the job asks for it (torchtitan's default under PP); a group size is not replayed (why_not)
    raf = reshard_after_forward(Job.of(inv, s, MODEL)) is True
    n, r = shard_group_size(s), s.recipe
    cb = unshard_bytes(r)
    position = {t.name: i for i, t in enumerate(inv.tensors)}

    def group(ts: list[Any]) -> FsdpGroup:
        return fsdp_group(ts, position, n, r, cb)

    # per local stage: its block groups, its root group, its blocks' experts groups (expert parallelism: each
    # MoE block's routed experts fully_shard-ed over the expert-FSDP ranks before the block, with the block's
    # reshard_after_forward: torchtitan's apply_fsdp; fsdp2_replay.replay's units)
    groups: list[tuple[tuple[FsdpGroup, ...], FsdpGroup, dict[int, FsdpGroup]]] = []
    numels: list[tuple[int, int]] = []
    ew = 0
    for ts in stage_tensors(inv, prof.stages):
        blocks: dict[str, list[Any]] = {}
        root: list[Any] = []
        for t in ts:
            (root if t.block == ROOT_BLOCK else blocks.setdefault(t.block, [])).append(t)
        experts: dict[int, FsdpGroup] = {}
        for i, b in enumerate(list(blocks.values())):
            xs = [t for t in b if t.shard_split > 1]
            if xs:
                ew = tensor_group(xs[0], n)  # the expert-FSDP group (layouts: the engine's own)
                experts[i] = g = fsdp_group(xs, position, ew, r, cb)
                numels.extend((k, p // ew) for k, p in zip(g.params, g.padded))
                b[:] = [t for t in b if t.shard_split == 1]
        block_groups = tuple(group(b) for b in blocks.values())
        root_group = group(root)
        for g in (*block_groups, root_group):
            numels.extend((i, p // n) for i, p in zip(g.params, g.padded))
        groups.append((block_groups, root_group, experts))
    numels.sort()
    opt_job = replay_job(inv, replace(s, activation_profile=prof.stages[0].profile, grad_accum=1), [k for _, k in numels])
    parts = _parts(inv, s)

    run = Run(config or AllocatorConfig(), opt_job.buffers)
    for bg, rg, xg in groups:  # to_empty: the shards in module order
        units = (*bg, rg, *xg.values())
        for i in sorted(i for g in units for i in g.params):
            for g in units:
                if i in g.params:
                    run.alloc(g.shard[g.params.index(i)])

    def stages(grads: list[Any]) -> list[Any]:
        out = [_Stage(run, x.job, bg, rg, n, r.reduced_grad_bytes, r.grad_bytes, grads, raf, xg, ew)
               for x, (bg, rg, xg) in zip(parts, groups)]
        for st in out:
            st.cpu_cast = s.cluster.device == "cpu"
        return out
    _walk(run, s, parts, opt_job, stages)
    return run.a


class _DdpStage:
    """One model part of the rank under DistributedDataParallel through pipeline steps (a DDP module per stage,
    torch.distributed.pipelining's stage.py backward_maybe_with_nosync; the Reducer in c10d reducer.cpp):

    - at construction the Reducer allocates one bucket for all the stage's parameters that require grad (no
      find_unused_parameters: bucket_size_limits [sys.maxsize]); with find_unused_parameters, buckets by size
      from the start and never rebuilt, and its int32 map of used parameters on the device;
    - every forward runs outside no_sync (the schedule wraps only the backward in it), so DDP's _post_forward
      calls reducer.prepare_for_backward and the backward's hooks (post-hooks of each parameter's
      AccumulateGrad) run: the first backward records the order the gradients were ready, and the next forward's
      _pre_forward rebuilds the buckets in that order (limits [1 MiB, bucket_cap_mb]: the old buckets dropped,
      then the new allocated; ``release`` "grad": the last all-reduce's bucket held by the process group until
      the next backward, as ddp_replay.replay_ddp has it);
    - the step's first backward of the stage keeps autograd's gradients as .grad (AccumulateGrad takes them);
      later ones are added into them and freed. With gradient_as_bucket_view each gradient is copied into its
      bucket view by the hook and freed (mark_variable_ready_dense), the buckets being the gradients;
    - a split backward's weight step (stage_backward_weight) sets ``weight.grad = dw`` or adds into it, with no
      hook (autograd.grad over the accumulators does not run them): the weight gradients made together, kept at
      the step's first, freed after the later ones; the buckets never rebuilt;
    - REDUCE_GRAD (perform_reduce_grad) does nothing for DDP but scale the gradients in place.
    """

    input_only = False  #: an input-gradient step (I): no weight gradients

    def __init__(self, run: Run, trainable: list[int], limits: tuple[int, ...], view: bool, release: str,
                 unused: bool) -> None:
        from memplan.frameworks.ddp_replay import unused_buckets

        self.run, self.limits, self.view, self.release = run, limits, view, release
        if unused:
            self.buckets = unused_buckets(run, trainable, limits)
        else:
            self.buckets = [run.alloc(sum(trainable))]
        self.rebuilt = unused  #: find_unused_parameters: never rebuilt (reducer.h should_rebuild_buckets)
        self.first: list[tuple[Any, int]] | None = None  #: the first hooked backward's gradients, in order made
        self.old: list[Any] = []
        self.making: list[tuple[Any, int]] = []
        self.grads: list[Any] = []
        self.has = False  #: the step's gradients exist (.grad set by an earlier backward of the step)
        self.bwd = None

    def new_step(self, grads: list[Any]) -> _DdpStage:
        self.grads, self.has = grads, False
        return self

    def region(self, kind: str, blk: int) -> None:
        pass

    def forward_returned(self) -> None:
        pass

    def begin_forward(self) -> None:
        from memplan.frameworks.ddp_replay import rebuilt_buckets

        if self.first is None or self.rebuilt:
            return
        self.rebuilt = True  # Reducer::rebuild_buckets, from _pre_forward
        self.old = self.buckets
        if self.release == "pre":
            for k in self.old:
                self.run.free(k)
            self.old = []
        self.buckets = rebuilt_buckets(self.run, self.first, self.limits)

    def begin_backward(self) -> None:
        self.making = []

    def on_grad(self, size: int, key: Any, blk: int) -> bool:
        if self.old:
            for k in self.old:
                self.run.free(k)
            self.old = []
        self.making.append((key, size))
        if self.view or self.has:
            return False  # copied into its bucket view, or added into .grad: freed where the trace frees it
        self.grads.insert(0, key)  # zero_grad frees the last made first
        return True

    def end_backward(self) -> None:
        if self.making:
            self.has = True
            if self.first is None:
                self.first = self.making

    def weight_step(self, births: list[tuple[int, int]]) -> None:
        keys = [self.run.alloc(size) for size, _ in births]
        if self.has:
            for k in keys:
                self.run.free(k)
        else:
            self.grads[:0] = reversed(keys)
        self.has = self.has or bool(keys)

    def reduce(self) -> None:
        pass


def _replay_ddp(inv: Any, s: Any, config: AllocatorConfig, release: str) -> Allocator:
    from memplan.frameworks.ddp_replay import DDP_BROADCAST_BUCKET, _broadcast_coalesced, bucket_limits
    from memplan.replay import build_model, replay_job

    prof = s.activation_profile
    steps = [t for t in inv.tensors if t.trainable]
    opt_job = replay_job(inv, replace(s, activation_profile=prof.stages[0].profile, grad_accum=1),
                         [t.numel for t in steps], [t.shape for t in steps])
    parts = _parts(inv, s)
    run = Run(config or AllocatorConfig(), opt_job.buffers)
    build_model(run, opt_job)
    rc = s.recipe
    limits = bucket_limits(s.torch.bucket_cap_mb, s.torch.bucket_cap_default)
    ddp = []
    for ts in stage_tensors(inv, prof.stages):  # DDP(part) per stage: its states broadcast, its Reducer
        _broadcast_coalesced(run, [t.numel * rc.param_bytes for t in ts], DDP_BROADCAST_BUCKET)
        ddp.append(_DdpStage(run, [t.numel * rc.grad_bytes for t in ts if t.trainable or t.unused], limits,
                             s.torch.gradient_as_bucket_view, release, bool(inv.unused_params)))
    _walk(run, s, parts, opt_job, lambda grads: [d.new_step(grads) for d in ddp])
    return run.a


def _walk(run: Run, s: Any, parts: list[_Part], opt_job: ReplayJob, stages_of: Any) -> None:
    """The rank's action list, step after step until the reserved peak settles: ``stages_of(grads)`` gives each
    local stage's framework object for a step, the gradients it keeps to zero_grad put in ``grads``."""
    prof = s.activation_profile
    rs = prof.actions
    schedule, pp, m, per_rank, rank = rs.schedule, rs.pp, rs.micro_batches, rs.per_rank, rs.rank
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
        stages = stages_of(grads)
        # the step's batch on the first stage (split into micro-batch views) and its targets on the last
        ids = [run.alloc(opt_job.input_bytes * m) for on in (any(x.first for x in prof.stages),
                                                             any(x.last for x in prof.stages)) if on]
        offsets: dict[tuple[int, int], int] = {}
        cached: dict[tuple[int, int], Any] = {}
        held_for_w: dict[tuple[int, int], list[Any]] = {}
        casts: dict[int, int] = {}  # each stage's first forward of the step: its casts' keys from its offset
        for idx, (stage, kind, mb) in enumerate(actions):
            c = local[stage]
            x = parts[c]
            job, bwd, split = x.job, x.bwd, x.split
            st = stages[c]
            if kind == schedules.F:
                offsets[c, mb] = run.offset()
                st.begin_forward()
                fwd = x.later if c in casts else x.first
                casts.setdefault(c, offsets[c, mb])
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
                # backward_one_chunk pops the micro-batch's fwd_cache entry first, but its local ``stage_output``
                # holds the output until the backward returns
                out = cached.pop((c, mb), None)
                st.begin_backward()
                off = offsets.pop((c, mb))
                if kind == schedules.I:
                    assert split is not None
                    st.input_only = True
                    micro_step(run, job, keep_grads=False, at=st.region, on_grad=st.on_grad,
                               on_forward_end=None, events=split[0], off=off)
                    if out is not None:
                        run.free(out)
                    st.input_only = False
                    st.bwd = None
                    # param_group["grads"]: each linear's output gradient, kept for W (parallel.zero_bubble_grads)
                    kept = prof.stages[c].kept_for_w
                    keep = [run.alloc(kept * s.micro_batch)] if kept else []
                    held_for_w[c, mb] = [off + k for k in split[1]] + keep
                    continue
                # the stage's on_grad keeps what its framework keeps
                micro_step(run, job, keep_grads=False, at=st.region, on_grad=st.on_grad,
                           on_forward_end=None, events=bwd, off=off)
                if out is not None:
                    run.free(out)
                st.end_backward()
                if last_backward.get(c) == idx:
                    st.reduce()
        for c, off in casts.items():  # the autocast region exits: its cache cleared
            for k in parts[c].casts:
                run.free(off + k)
        for k in ids:
            run.free(k)
        optimizer_step(run, opt_job, step == 0, states)
        for k in grads:  # zero_grad(set_to_none)
            run.free(k)
        run.end_step()
        if step >= 1 and run.a.peak_reserved == before:
            break
