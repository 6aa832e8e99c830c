"""Accounting: inventory + settings -> Plan. Pure integer arithmetic; no torch, no printing.

Per rank, per phase (forward, loss, backward start/end, optimizer step), the bytes of every category:
weights, master weights, gradients, optimizer states, activations, buffers. The reported peak is the maximum
over phases, with the phase named. Overheads (CUDA context, NCCL, fragmentation) are separate and only enter
the fit verdict. Every framework default used is in ``assumptions``.

Layout-dependent sizes (shard numel per rank, gathered block sizes) are computed once per
(inventory, layout, shard count) and cached, which is what lets the planner evaluate many configurations.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memplan import activations as act
from memplan import frameworks, layouts
from memplan.comm import communication, model_parallel
from memplan.host import host_report
from memplan.parallel import schedules
from memplan.frameworks.common import FrameworkModel, Grads, Job, OffloadedGrads, StepIn
from memplan.model.inventory import ParamInventory
from memplan.precision import step_temporaries
from memplan.settings import (  # noqa: F401  (re-exported: the library's names for the settings types)
    BLAS_HANDLES, Cluster, DeepSpeedKnobs, Overheads,
    RankState, Settings, TorchKnobs, default_blas_workspace, optimizer_impl, shard_group_size, with_gpus)
from memplan.moments import Fixed, moments_at, phases
from memplan.plan import PHASE_NAMES, EvaluatedMoment, Phase, PhaseBytes, Plan, StepTimeline  # noqa: F401  (the API)
from memplan.timeline import CATEGORY_KEYS, BufferTimeline, Moment, StepMoment


def _model_states(job: Job, fw: FrameworkModel, host_by: dict[str, int]) -> tuple[int, int, int, int]:
    """(weights, master weights, optimizer states, master bytes per element) a rank keeps on the device between
    steps; what offload moves to the host goes to ``host_by``."""
    s, st, rc = job.s, job.s.strategy, job.s.recipe
    weights = fw.weights(job)
    master_bytes = 4 if st.fp32_master_copy else rc.master_bytes
    master = master_bytes * job.lay.optimizer_numel
    if s.optimizer.per_tensor:  # Muon with AdamW, Adam-mini: per named tensor of the whole model
        from memplan.precision import per_tensor_states

        states = per_tensor_states(s.optimizer, job.inv, rc, s.cluster.gpus)
    else:
        states = layouts.optimizer_state_bytes(s.optimizer, rc, job.lay,
                                               fw.optimizer_tensors(job) if s.optimizer.shape_dependent else ())
    if job.offload_param:
        # the partitioned parameters live on the host (offload_param.device "cpu"); persistent ones stay
        host_by["weights_bytes"] += weights - rc.param_bytes * job.lay.persistent_numel
        weights = rc.param_bytes * job.lay.persistent_numel
    if job.offload_optimizer or job.cpu_offload:
        host_by["master_weights_bytes"] += master
        host_by["optimizer_states_bytes"] += states
        master = states = 0
    if job.cpu_offload:
        host_by["weights_bytes"] += weights
        weights = 0
    weights += device_buffers(job.inv, s)
    return weights, master, states, master_bytes


def device_buffers(inv: ParamInventory, s: Settings) -> int:
    """The model's buffers on a rank: whole under every strategy and offload (ParamInventory.buffers), in the
    recipe's dtype, each in whole 512-byte blocks on CUDA (the caching allocator's rounding)."""
    return inv.buffer_bytes(s.recipe.half_buffers, 512 if s.cluster.device == "cuda" else 1)


def _gradients(job: Job, fw: FrameworkModel, host_by: dict[str, int]) -> tuple[Grads, OffloadedGrads]:
    """Gradients on the device at backward's end and between steps, after what offload moves to the host."""
    st, rc, opt_numel = job.s.strategy, job.s.recipe, job.lay.optimizer_numel
    end, persist = fw.grads_at_end(job), 0
    if st.persistent_grads:
        persist = rc.grad_bytes * opt_numel  # ZeRO-3 grad_partitions_flat_buffer (accumulation dtype)
        end = persist
    elif fw.whole_step_grads(job):
        persist = end = fw.whole_step_grads(job)
    if job.s.grad_accum > 1:
        persist = max(persist, fw.accumulated_grads(job, end))  # grads live across micro-steps
    if job.cpu_offload:
        host_by["grads_bytes"] += end
        # FSDP2 sends each reduced gradient to the host as it is reduced; FSDP1 keeps the reduced shards on the
        # device to backward's end (its final callback points .grad at _cpu_grad), so they are there at its end
        end = 0 if fw.offloads_each_reduced_grad else end
        persist = 0
    off = OffloadedGrads()
    if job.offload_optimizer:
        off = fw.offload(job, Grads(end=end, persist=persist), host_by)
        end, persist = 0, off.kept_grads
    return Grads(end=end, persist=persist), off


def _step(job: Job, fw: FrameworkModel, grads: Grads, persistent: int, master_bytes: int,
          a: dict[str, Any], off: OffloadedGrads) -> tuple[int, int]:
    """(grads, buffers) at the optimizer step: the optimizer's scratch, then the framework's own step."""
    rc, lay = job.s.recipe, job.lay
    impl = optimizer_impl(job.s)
    scratch = 0
    if job.s.optimizer.per_tensor:
        from memplan.activations.kernels import cpu_gemm_scratch, host_cpu_isa
        from memplan.precision import per_tensor_step_scratch

        c = job.s.cluster
        isa = c.cpu_isa or host_cpu_isa()
        # off CUDA Muon's Newton-Schulz products are bf16 GEMMs with oneDNN's own scratch (one thread: the
        # harness's), and Adam-mini's mean of a 16-bit input an fp32 copy
        gemm = (lambda m, n, k: cpu_gemm_scratch(isa, m, n, k, "bfloat16")) if c.device == "cpu" else None
        scratch = per_tensor_step_scratch(job.s.optimizer, job.inv, rc, impl, gemm, c.device == "cpu", c.gpus)
    elif not (job.offload_optimizer or job.cpu_offload):
        if impl == "foreach":
            scratch = rc.state_bytes * lay.optimizer_numel
        elif impl == "single-tensor" and (job.s.optimizer.shape_dependent or job.s.optimizer.scratch):
            stepped = 4 if master_bytes == 4 else rc.param_bytes  # DeepSpeed's fp32 partitions, else the params
            scratch = step_temporaries(job.s.optimizer, impl, stepped, rc,
                                       [n for _, n in fw.optimizer_tensors(job)], job.s.cluster.device)
        elif impl == "single-tensor":
            scratch = rc.state_bytes * lay.single_step_scratch
    scratch = max(scratch, off.step_scratch)
    # with a master copy, the grads are copied into an fp32 partition for the step (DeepSpeed:
    # single_partition_of_fp32_groups[i].grad), after which the low-precision grads are freed
    step_grads = 0 if job.cpu_offload else grads.end  # offloaded: the step's gradients are the host's
    if master_bytes and not job.offload_optimizer:
        step_grads = rc.reduced_grad_bytes * lay.optimizer_numel + grads.persist
    step_grads, step_buffers, notes = fw.step(job, StepIn(grads=step_grads, buffers=persistent + scratch,
                                                          persistent=persistent, scratch=scratch, impl=impl,
                                                          grads_persist=grads.persist, master_bytes=master_bytes))
    a.update(notes)
    a["optimizer_impl"] = impl
    return step_grads, step_buffers


def _fixed(inv: ParamInventory, s: Settings) -> Fixed:
    """Everything in a Plan that does not depend on the micro-batch: model states, grads, buffers, overheads."""
    st, rc, c = s.strategy, s.recipe, s.cluster
    fw = frameworks.model(st.memory_model)
    job = Job.of(inv, s, fw)
    n, lay = job.n, job.lay
    a: dict[str, Any] = {"shard_group": n, "layout": st.layout}
    #: per rank, by category: what offload keeps in host memory
    host_by = {k: 0 for k in CATEGORY_KEYS if k != "activations_bytes"}
    weights, master, states, master_bytes = _model_states(job, fw, host_by)
    g, off = _gradients(job, fw, host_by)
    host = sum(host_by.values())

    # ---- buffers: the framework's timeline, and what every job on a GPU keeps ----
    tl = fw.buffers(job, g)
    a["overlap_comm"] = job.overlap
    buf_persist = tl.persistent + off.device_buffer + s.rank.pipeline_accumulator_bytes
    buf_bwd = tl.backward
    if c.device == "cuda":
        # one cuBLAS handle per thread that runs GEMMs: forward (and the optimizer) on the main thread, backward
        # (recomputation too) on the autograd engine's device thread; each gets its own workspace on the stream
        # and keeps it (thread-local handle pool windows, workspaces keyed by (handle, stream))
        buf_persist += BLAS_HANDLES * c.blas_workspace_bytes
        a["blas_workspace"] = f"{BLAS_HANDLES} x {c.blas_workspace_bytes} B (cuBLAS, forward and autograd threads)"
    a.update(tl.assumptions)
    step_grads, step_buffers = _step(job, fw, g, buf_persist, master_bytes, a, off)

    # ---- activations: the profile for one micro-batch; the terms follow the micro-batch exactly ----
    prof = s.activation_profile
    if prof is None:
        gated = bool(inv.dims.get("gated_mlp", 1))
        prof = act.cached_profile(tuple(sorted(inv.dims.items())), 1, s.seq_len, rc.compute_bytes,
                                  rc.residual_bytes, s.attention, s.recompute, gated)
    if fw.computes_with_views and isinstance(prof, act.TracedProfile):
        prof = replace(prof, cached_casts=False, _memo={})
    a["activations"] = prof.source
    # torch-amp: autocast's bf16 copies of the fp32 weights are saved for backward by every matmul (the traced
    # profile measures them; the analytic one does not).
    amp_copies = 0
    if rc.autocast_weight_copies and not prof.includes_autocast_copies:
        amp_copies = rc.compute_bytes * lay.matmul_numel
    f = _assemble(s, tl, g, (weights, master, states), (buf_persist, buf_bwd, amp_copies),
                  (step_grads, step_buffers), prof, a, host_by, host)
    # the accumulators are freed at the reduce (a negative figure: the reduced shards the step keeps exceed the
    # accumulators it holds at the moment, accounting.Layout._at_rank; they stay)
    f.between += s.rank.pipeline_buffer_bytes * s.micro_batch - max(s.rank.pipeline_accumulator_bytes, 0)
    f.per_sample = s.rank.pipeline_buffer_bytes
    return f


def _assemble(s: Settings, tl: BufferTimeline, g: Grads, model_states: tuple[int, int, int],
              held: tuple[int, int, int], step: tuple[int, int], prof: Any, a: dict[str, Any],
              host_by: dict[str, int], host: int) -> Fixed:
    """The step's phases and moments, everything but activations, from the framework's timeline."""
    c, rc = s.cluster, s.recipe
    weights, master, states = model_states
    buf_persist, buf_bwd, amp_copies = held
    step_grads, step_buffers = step
    grads_end, grads_persist = g.end, g.persist

    # Per phase, everything but activations:
    #   forward:        the end of forward, loss included
    #   backward-start: the loss backward; every activation alive, plus the loss's backward transients
    #   backward:       the last block's grads complete and being reduced: its own activations freed, the loss
    #                   freed; gathered blocks, the block's unsharded grads and reduce buffers
    #   backward-end:   every gradient produced, the root's reduce
    #   optimizer-step: the step's scratch
    end_grads = max(grads_end, grads_persist)
    end_buffers = max(tl.gathered_backward, tl.gathered_end) + tl.end_epilogue
    if tl.end is not None:
        end_buffers, end_grads = tl.end[0], max(grads_end - tl.end[1], grads_persist)
    grads = (grads_persist, grads_persist, grads_persist, end_grads, step_grads)
    across = tl.micro_steps_held
    buffers = (buf_persist + across + tl.gathered_forward_end + amp_copies,
               buf_persist + across + tl.gathered_loss + amp_copies,
               buf_persist + across + buf_bwd + max(tl.gathered_forward_most, tl.gathered_backward) + amp_copies,
               buf_persist + across + buf_bwd + end_buffers,
               step_buffers)
    states_total = weights + master + states
    comms = 0
    if c.device == "cuda":
        comms = (1 + (1 if s.strategy.shard_within_node else 0) + (1 if s.ds.hpz_partition_size > 1 else 0)) \
            if c.gpus > 1 else 0
        comms += s.rank.model_parallel_groups  # a model-parallel rank's TP and PP groups (each its own communicator)
        a["nccl_communicators"] = comms
    moments = []
    # FSDP2's CPU offload: each reduced shard is copied to the host as it is reduced (foreach_reduce:
    # new_sharded_grad.to("cpu"), the device output freed), so none stays on the device through backward
    fm = frameworks.model(s.strategy.memory_model)
    grads_on_host = s.torch.cpu_offload and fm.cpu_offload_policy and fm.offloads_each_reduced_grad
    for m in tl.moments:
        m_buffers = m.buffers + buf_persist + across + buf_bwd + amp_copies
        if m.at == Moment.LOSS_BACKWARD:  # what is gathered at the loss, no reduce bucket yet
            m_buffers += tl.gathered_loss - buf_bwd
        # grads kept across micro-steps include those of the moment
        m_grads = grads_persist if grads_on_host else max(m.grads, grads_persist)
        moments.append(StepMoment(m_grads, m_buffers, states_total + m_grads + m_buffers, m.at))
    f = Fixed(weights, master, states, grads, buffers,
               tuple(states_total + gr + b for gr, b in zip(grads, buffers)), prof, host * c.ranks_per_node,
               a["shard_group"], weights + master + states + grads_persist + buf_persist, comms, a, tuple(moments),
               rc.grad_bytes, {k: v for k, v in host_by.items() if v})
    f.grads_held = tl.grads_held
    f.first_hook_grads_persist = tl.first_hook_grads_persist and grads_persist > 0
    f.hook_transient = tl.hook_transient
    return f


def timeline(inv: ParamInventory, s: Settings) -> StepTimeline:
    """The step's timeline without activations, for these settings (tests and explanations read it)."""
    f = _fixed(inv, s)
    return StepTimeline(weights=f.weights, master_weights=f.master, optimizer_states=f.states,
                        grads=dict(zip(PHASE_NAMES, f.grads)), buffers=dict(zip(PHASE_NAMES, f.buffers)),
                        moments=f.moments, grad_width=f.grad_width, grads_held=f.grads_held,
                        hook_transient=f.hook_transient, assumptions=dict(f.assumptions))


def evaluate_moments(inv: ParamInventory, s: Settings) -> list[EvaluatedMoment]:
    """Every named moment of the step the activation profile can evaluate, at the settings' micro-batch."""
    f = _fixed(inv, s)
    fwd, _, saved, emb, block = f.profile.terms(s.recompute, s.micro_batch)
    return [EvaluatedMoment(m, x, gx) for m, x, gx in moments_at(f, s.micro_batch, saved, block, emb, fwd)]


def _overheads(s: Settings, f: Fixed, peak: int, reserved: Any) -> dict[str, int]:
    """What the fit verdict adds to the allocated peak: the CUDA context, NCCL's buffers, and the caching
    allocator's segments beyond the allocated bytes (the replayed reserved peak less the allocated one), or the
    user's flat --fragmentation-percent. Where neither is there, nothing: the figure is a bound from below
    (Plan.reserved_bound)."""
    if s.cluster.device != "cuda":
        return {}
    o = s.overheads
    out = {"cuda_context_bytes": o.cuda_context_bytes, "nccl_bytes": _nccl(s, f)}
    if o.fragmentation_percent is not None:
        out["fragmentation_bytes"] = peak * o.fragmentation_percent // 100
    elif reserved is not None:
        out["allocator_bytes"] = max(reserved.peak_bytes - peak, 0)
    return out


def _nccl(s: Settings, f: Fixed) -> int:
    """NCCL's buffers: one allowance per communicator the job makes."""
    return f.comms * s.overheads.nccl_bytes_per_communicator


def _reserved(inv: ParamInventory, s: Settings, f: Fixed, limit: int | None = None) -> tuple[Any, str | None]:
    """The caching allocator's replay for these settings, or (None, why not); ``limit``: stop once the reserved
    bytes pass it (a search only asks whether they do). Where ``limit`` is the card's limit on the allocator (the
    card less the CUDA context and NCCL, as _verdict takes it), the one replay serves the verdict too."""
    if s.cluster.device != "cuda":
        return None, None
    from memplan import reserved

    why = reserved.why_not(s, inv)
    if why is not None:
        return None, why
    mem = s.cluster.gpu_memory_bytes
    card = None if mem is None else mem - s.overheads.cuda_context_bytes - _nccl(s, f)
    return reserved.predict(inv, s, limit=limit, card=card), None


def estimate(inv: ParamInventory, s: Settings, reserved_limit: int | None = None) -> Plan:
    """The Plan for one configuration. ``reserved_limit``: the replay may stop once the reserved bytes pass it,
    and the Plan then holds a reserved peak that is only known to be above it (enough to say it does not fit)."""
    # parameters no loss reads, as the framework trains them (frameworks.with_unreached)
    inv = frameworks.with_unreached(inv, s)
    if _parallel(s):
        return _estimate_layout(inv, s, reserved_limit)
    f = _fixed(inv, s)
    rows = tuple(PhaseBytes(name, weights_bytes=f.weights, master_weights_bytes=f.master, grads_bytes=g,
                       optimizer_states_bytes=f.states, activations_bytes=x, buffers_bytes=b)
                 for name, (g, x, b) in zip(PHASE_NAMES, phases(f, s.recompute, s.micro_batch)))
    totals = [p.total_bytes for p in rows]
    peak = rows[totals.index(max(totals))]
    res, why = (_reserved(inv, s, f, reserved_limit) if s.overheads.fragmentation_percent is None
                else (None, "fragmentation given"))
    shift = 0
    if res is not None and getattr(s.activation_profile, "inner", None) is not None:
        before = res.allocated_bytes
        res = res.moved_to(peak.total_bytes)  # a tensor-parallel rank: its share's replay (reserved.py)
        shift = res.allocated_bytes - before
    detail = _overheads(s, f, peak.total_bytes, res)
    flat = s.overheads.fragmentation_percent if s.cluster.device == "cuda" else None
    capped, verdict = _verdict(inv, s, res, peak.total_bytes, detail, reserved_limit, shift)
    plan = Plan(settings=s, inventory=inv, phases=rows, peak=peak, overhead_bytes=sum(detail.values()),
                overhead_detail=detail, host_bytes_per_node=f.host_per_node, host_detail=f.host_detail,
                shard_group=f.shard_group,
                between_steps_bytes=f.between, assumptions=dict(f.assumptions), reserved=res, reserved_why=why,
                capped=capped, verdict_required_bytes=verdict, communication=communication(inv, s),
                fragmentation_percent=flat,
                bounded=why if s.cluster.device == "cuda" and res is None and flat is None else None)
    return replace(plan, host=host_report(plan))


def _verdict(inv: ParamInventory, s: Settings, res: Any, allocated: int, detail: dict[str, int],
             reserved_limit: int | None, shift: int) -> tuple[Any, int | None]:
    """The replay under the card's limits (reserved.capped) and the card bytes the verdict compares: the capped
    reserved peak P (on out of memory, the uncapped one, above the limit) plus what the card keeps from the
    allocator: the memory outside it (CUDA context, NCCL), and under a per_process_memory_fraction the rest of
    the card past the fraction. It fits exactly when the capped replay runs through. ``reserved_limit`` (a search's
    budget, where the uncapped replay stopped early) does not move the card's limit."""
    mem = s.cluster.gpu_memory_bytes
    if s.cluster.device != "cuda" or res is None or mem is None:
        return None, None
    from memplan import reserved
    from memplan.allocator import AllocatorConfig

    outside = detail.get("cuda_context_bytes", 0) + detail.get("nccl_bytes", 0)
    # the card's limit, whatever a search's budget: the job runs on the card, and a budget (--min-headroom) asks
    # that the card's figure leave the margin, not that the allocator flush to stay inside it
    device_limit = mem - outside
    fraction = AllocatorConfig.parse(s.allocator_conf).per_process_memory_fraction
    fraction_limit = int(fraction * mem) if fraction < 1.0 else None
    capped = reserved.capped(inv, s, device_limit, fraction_limit, res, shift)
    if capped is None:
        return None, None
    # never below the allocated peak (the engine's, which the replay reaches by another road: reserved >= allocated,
    # as the uncapped figure keeps it); out of memory: the uncapped reserved peak, above the limit
    uncapped = allocated + detail.get("allocator_bytes", 0)
    peak = max(capped.peak_bytes if capped.fits else max(uncapped, capped.limit_bytes + 1), allocated)
    return capped, peak + device_limit + outside - capped.limit_bytes


def allocator_modelled(inv: ParamInventory, s: Settings) -> bool:
    """Whether required_bytes' allocator term is modelled (the caching allocator replayed, or the user's flat
    --fragmentation-percent) for every rank of the job; False where the figure is only a bound from below."""
    if s.cluster.device != "cuda" or s.overheads.fragmentation_percent is not None:
        return True
    from memplan.reserved import why_not

    if _parallel(s):
        lay = layout(inv, s)
        return all(why_not(v, r_inv) is None for i, (_, r_inv, _) in enumerate(lay.ranks) for v in lay.at(i))
    return why_not(s, frameworks.with_unreached(inv, s)) is None


def required_bytes(inv: ParamInventory, s: Settings, micro_batches: Any,
                   lower_bound: bool = False, budget: int | None = None) -> list[tuple[int, int]]:
    """(peak_bytes, required_bytes) for each micro-batch, the other settings fixed: the batched evaluator.

    The micro-batch-independent part is computed once; each micro-batch then costs a few integer operations
    and gives exactly what ``estimate(inv, replace(s, micro_batch=b))`` gives (tested). Where the caching
    allocator is replayed (memplan/reserved.py) each micro-batch is an estimate; ``lower_bound`` leaves the
    allocator's term out instead (the reserved peak is never below the allocated one), the fast bound a search
    narrows with before it replays; ``budget``: a replay may stop once the required bytes pass it (the
    figure returned is then only known to be above it).
    """
    if _parallel(s):  # the most loaded pipeline rank's, at each micro-batch
        lay = layout(inv, s)
        micro_batches = list(micro_batches)
        per_rank = [required_bytes(r_inv, v, micro_batches, lower_bound, budget)
                    for i, (_, r_inv, _) in enumerate(lay.ranks) if i not in lay.dominated for v in lay.at(i)]
        return [max(rows, key=lambda r: r[1]) for rows in zip(*per_rank)]
    f = _fixed(inv, s)
    rec, o = s.recompute, s.overheads
    fixed_over = (o.cuda_context_bytes + _nccl(s, f)) if s.cluster.device == "cuda" else 0
    frag = 0
    if s.cluster.device == "cuda":
        if o.fragmentation_percent is not None:
            frag = o.fragmentation_percent
        elif not lower_bound:
            from memplan.reserved import why_not

            if why_not(s, inv) is None:  # the replay, one micro-batch at a time
                limit = None if budget is None else budget - fixed_over
                return [(p, r) for p, r in ((e.peak_bytes, e.required_bytes) for e in
                                            (estimate(inv, replace(s, micro_batch=b), limit)
                                             for b in micro_batches))]
            # not replayed: the allocated peak bounds the reserved one from below (replayable says which)
    # the same phases as estimate's (_phases), their total only
    states = f.weights + f.master + f.states
    out = []
    for b in micro_batches:
        peak = states + max(g + x + buf for g, x, buf in phases(f, rec, b))
        out.append((peak, peak + fixed_over + peak * frag // 100))
    return out


def host_fits(inv: ParamInventory, s: Settings) -> bool | None:
    """The host verdict alone (no activations, no replay): whether a node's RAM holds the offloaded states."""
    from types import SimpleNamespace

    f = _fixed(inv, s)
    rep = host_report(SimpleNamespace(settings=s, inventory=inv, host_detail=f.host_detail, shard_group=f.shard_group))
    return None if rep is None else rep["fits"]


# ---- tensor and pipeline parallelism: each pipeline rank's share, sized as a model of its own ----

class Layout:
    """A model-parallel job as given (``inventory``, ``settings``) and each pipeline rank's share with the settings
    its data-parallel group runs (memplan/parallel/)."""

    __slots__ = ("inventory", "settings", "name", "dp", "dp_per_node", "ranks", "plans", "worst", "unsharded",
                 "dominated", "_at", "peak_moments")

    def __init__(self, inv: ParamInventory, s: Settings) -> None:
        from math import gcd

        from memplan import parallel as par

        p = s.parallel
        self.inventory, self.settings = inv, s
        self.name = par.check(p, inv, s.strategy, s.cluster.gpus, s.grad_accum)
        # context parallelism: a rank computes seq / cp tokens of each sequence (its data-parallel group, dp x cp,
        # is what shards the parameters: gpus / (tp x pp))
        s = replace(s, seq_len=s.seq_len // p.cp)
        dp = s.cluster.gpus // p.model_ranks
        per_node = gcd(dp, max(1, s.cluster.gpus_per_node // p.tp))
        self.dp, self.dp_per_node = dp, per_node
        loss_prof, bare_prof = p.profiles or (None, None)
        rc = s.recipe
        out = []
        peak_moments: list[tuple[tuple[Any, int, bool, bool], ...] | None] = []
        for share in par.shares(inv, p, self.name, s.grad_accum):
            r_inv = share.inventory

            def chunk_profile(layers: int, last: bool) -> Any:
                base = loss_prof if last else bare_prof
                if base is not None:
                    return act.at_layers(base, layers)
                dims = dict(r_inv.dims, num_layers=max(layers, 1))  # a stage of the embedding or head alone: 0
                if not last:
                    dims["vocab_size"] = 0
                elif not p.loss_parallel and self.name == par.TORCHTITAN:  # the loss on the gathered logits
                    dims["vocab_size"] = inv.dims.get("vocab_size", 0)
                gated = bool(dims.get("gated_mlp", 1))
                prof = act.cached_profile(tuple(sorted(dims.items())), 1, s.seq_len, rc.compute_bytes,
                                          rc.residual_bytes, s.attention, s.recompute, gated)
                return prof if layers else act.at_layers(prof, 0)

            v = len(share.chunks)
            #: a rank of several stages: the backwards that can peak, each as (its counts, its stage, its kind,
            #: the trainable parameters accumulated before it, whether the embedding's are among them, whether its
            #: own stage's are)
            candidates: list[tuple[Any, ...]] = []
            if v > 1:  # interleaved: each stage's micro-batches in flight with that stage's own profile, at the
                # backward where they hold the most (at a micro-batch of 1)
                profs = [chunk_profile(len(c.layers), c.last) for c in share.chunks]
                kept: list[act.Terms] = [pr.terms(s.recompute, 1) for pr in profs]
                # each held micro-batch keeps its own stage's output in fwd_cache: the last stage's logits, another
                # stage's hidden state (measured against the replay of the rank holding the last stage, llama-3-8b,
                # pp 4, seq 4096: interleaved +16%, looped-BFS +17% when each kept the logits)
                outs = [s.seq_len * (par.stage_output(inv.dims, p, self.name, c.last, rc)
                                     + par.stage_input(inv.dims, p, self.name, c.first, rc)) for c in share.chunks]
                params = [sum(t.numel for t in ts if t.trainable) for ts in _chunk_tensors(r_inv, share.chunks)]

                def load(moment: tuple[Any, ...]) -> int:
                    counts, cur, kind = moment[:3]
                    graph = 0
                    if kind == schedules.I:  # the input-gradient step keeps its graph (below)
                        n = len(share.chunks[cur].layers)
                        graph = par.zero_bubble_grads(share.inventory.dims, n, s.seq_len, rc.compute_bytes) \
                            + n * kept[cur].block
                    others = sum((n - (c == cur)) * (kept[c].saved_less_block + kept[c].block)
                                 for c, n in enumerate(counts))
                    held_outputs: int = sum(n * outs[c] for c, n in enumerate(counts))
                    return int(kept[cur].backward_start + graph + others + held_outputs)

                def accumulated(moment: tuple[Any, ...]) -> int:
                    return sum(n for n, done in zip(params, moment[3]) if done)

                # FSDP2 keeps each stage's unsharded accumulators from that stage's first backward on: the
                # backward holding the most activations, and the one holding the most with the accumulators
                # (a looped-BFS rank's first stage accumulates after every micro-batch of its second; an
                # interleaved rank's steady state holds both)
                every = par.backward_moments(p, share.rank, s.grad_accum)
                rb = rc.reduced_grad_bytes
                first_m = max(every, key=load)
                most_m = max(every, key=lambda m: load(m) + rb * accumulated(m))
                candidates = [(*m[:3], accumulated(m), any(done and c.first for done, c in zip(m[3], share.chunks)),
                               m[3][m[1]]) for m in ([first_m] if most_m is first_m else [first_m, most_m])]
                at_most, cur, kind = first_m[:3]
                counts = list(at_most)
                # the current micro-batch's profile at all the rank's blocks (what its buffers' timeline walks,
                # one model of the rank's blocks): it runs through one stage's, so under FSDP2 the other stages'
                # blocks' saved activations are taken off again (fewer_layers; measured on the harness's
                # interleaved, looped-BFS and DualPipeV rows). DDP keeps the bound: its multi-stage ranks are not
                # run on the harness (DDP over a rank's two model parts fails there), and its replay reads above
                # the engine without it (-6.4% at 12 blocks, pp 2, interleaved; tests/property)
                inner = chunk_profile(len(share.blocks), share.chunks[cur].last)
                trim = s.strategy.framework == "fsdp2"
                fewer = (len(share.blocks) - len(share.chunks[cur].layers)) * trim
                counts[cur] -= 1
                others = tuple((pr, n, o) for pr, n, o in zip(profs, counts, outs) if n)
                own_output: int | None = outs[cur]
            else:
                inner, others, fewer, kind = chunk_profile(share.layers, share.last), (), 0, schedules.B
                own_output = None
            per_block = par.sp_saving(inv.dims, p, self.name, rc.residual_bytes, rc.compute_bytes)
            k = act.checkpointed_blocks(s.recompute, share.layers)
            h = inv.dims.get("hidden_size", 0)
            ckpt = (h * rc.residual_bytes - h * rc.residual_bytes // p.tp) if per_block else 0
            less = s.seq_len * ((share.layers - k) * per_block + k * ckpt)
            if per_block and share.last and self.name == par.TORCHTITAN:  # the final norm, SequenceParallel too
                final = par.norm_saved(h, rc.residual_bytes)
                less += s.seq_len * (final - final // p.tp)
            loss = par.loss_parallel_extra(inv.dims, p, self.name, s.seq_len) if share.last else 0
            output = 0
            if p.pp > 1:
                if not share.last:  # the bare trace's final norm, which this stage does not run
                    less += s.seq_len * par.norm_saved(h, rc.residual_bytes)
                output = s.seq_len * (par.stage_output(inv.dims, p, self.name, share.last, rc)
                                      + par.stage_input(inv.dims, p, self.name, share.first, rc)) \
                    if own_output is None else own_output
            shared = 0
            if rc.autocast_weight_copies and inner.includes_autocast_copies and share.in_flight > 1:
                # torch.autocast caches each weight's cast for the region it is entered for (autocast_mode.cpp
                # cached_cast); a pipeline step runs every micro-batch in one region, so the micro-batches in
                # flight share one bf16 copy of each weight (measured: DDP x PP, torch-amp, +4.85% before)
                shared = rc.compute_bytes * sum(t.numel for t in r_inv.tensors if len(t.shape) >= 2 and
                                                (t.category != "embedding" or t.tied_names))
            # context parallelism: a traced profile ran the ring (memplan/activations/substitutes_sdpa.py _ring); the analytic
            # one adds its bound
            ring_f, ring_b = (0, 0) if loss_prof is not None else par.ring_attention(share.inventory.dims, p,
                                                                                      s.seq_len, rc.compute_bytes)
            graph = 0
            if p.pp > 1:
                # the input-gradient step keeps its linears' output gradients for the weight-gradient step, while
                # the stage's largest chunk runs its backward (per micro-batch of 1)
                # ... and frees none of the micro-batch's activations until then (the graph retained): the
                # chunk's blocks' saved activations stay through the whole input-gradient step
                most = max(len(c.layers) for c in share.chunks)
                graph = par.zero_bubble_grads(share.inventory.dims, most, s.seq_len, rc.compute_bytes) \
                    + most * inner.terms(s.recompute, 1).block
            if kind == schedules.I:
                ring_b += graph
            stages: tuple[Any, ...] = ()
            actions = None
            if p.pp > 1:
                # what the rank's replay walks (frameworks/pipeline_replay.py, pipe_engine_replay.py): each stage's
                # traced step, the output fwd_cache (DeepSpeed: the output slot) keeps and what a split backward's
                # input step keeps for W; torch's receive buffers, one per micro-batch for each stage's input
                # (after the first) and output gradient (before the last), DeepSpeed's one of each
                stages = tuple(schedules.StagePart(
                    profs[k] if v > 1 else inner, len(c.layers), c.first, c.last,
                    s.seq_len * par.stage_output(inv.dims, p, self.name, c.last, rc),
                    par.zero_bubble_grads(share.inventory.dims, len(c.layers), s.seq_len, rc.compute_bytes))
                    for k, c in enumerate(share.chunks))
                per_micro_batch = s.grad_accum if self.name == par.TORCHTITAN else 1
                actions = schedules.RankSchedule(
                    p.schedule, p.pp, s.grad_accum, p.virtual if p.multi_stage else 1, share.rank,
                    par.sp_tokens(s.seq_len, p) * h * rc.residual_bytes,
                    per_micro_batch * sum((not c.first) + (not c.last) for c in share.chunks), p.sp and p.tp > 1,
                    self.name, p.tp)
            prof = act.HeldProfile(inner, share.in_flight, less, loss, output, others, fewer, shared,
                                   recompute=s.recompute, ring_forward=ring_f,
                                   ring_backward=ring_b, stages=stages, actions=actions)
            if p.tp == 1 and p.pp == 1 and prof.adds_nothing:
                # context (or expert) parallelism alone: the rank's own traced step, as a data-parallel job's (its
                # allocation events let the reserved peak be replayed)
                prof = inner
            cluster = replace(s.cluster, gpus=dp, gpus_per_node=per_node)
            knobs = s.torch
            if p.pp > 1 and s.strategy.framework == "fsdp2" and knobs.reshard_after_forward is None:
                # torchtitan keeps the blocks unsharded after forward under pipelining (llama3/infra/
                # parallelize.py apply_fsdp: reshard_after_forward_policy "default" -> not pp_enabled): one
                # all-gather per block per step, not one per micro-batch
                knobs = replace(knobs, reshard_after_forward=False)
            rank = RankState(pipeline_stage=p.pp > 1,
                             model_parallel_groups=(p.tp > 1) + (p.pp > 1) + (p.cp > 1) + (p.ep > 1))
            out.append((share, r_inv, replace(s, parallel=None, cluster=cluster, activation_profile=prof,
                                               torch=knobs, rank=rank)))
            moments = []
            for counts2, cur2, kind2, acc2, emb2, again in candidates:
                if (counts2, cur2, kind2) == (at_most, cur, kind):
                    pv = prof
                else:
                    left = list(counts2)
                    left[cur2] -= 1
                    pv = replace(prof, inner=chunk_profile(len(share.blocks), share.chunks[cur2].last),
                                 held=sum(counts2), output=outs[cur2],
                                 fewer_layers=(len(share.blocks) - len(share.chunks[cur2].layers)) * trim,
                                 others=tuple((pr, n, o) for pr, n, o in zip(profs, left, outs) if n),
                                 ring_backward=ring_b + graph * ((kind2 == schedules.I) - (kind == schedules.I)),
                                 _memo={})
                # an input-gradient step (I) makes no weight gradient (its W does, later): as a later backward
                moments.append((pv, acc2, emb2, again or kind2 == schedules.I))
            peak_moments.append(tuple(moments) or None)
        self.ranks = tuple(out)
        #: per pipeline rank of several stages, its backwards that can peak: (its activation profile, the
        #: trainable parameters whose gradients are accumulated before it, the embedding's among them, whether it
        #: makes none of its own: its stage's are among them, or it is an input-gradient step); None: one stage
        self.peak_moments = tuple(peak_moments)
        #: ranks another one bounds (parallel.dominated): a search skips them
        self.dominated = par.dominated(tuple(share for share, _, _ in out))
        self._at: dict[int, list[Settings]] = {}
        #: per pipeline rank, its blocks unsharded (FSDP2 resharding them after forward; 0 where it keeps them)
        self.unsharded = tuple(self._unsharded(r_inv, r_s) for _, r_inv, r_s in out)
        self.plans: tuple[Plan, ...] = ()
        self.worst = 0

    @staticmethod
    def _accumulators(r_inv: ParamInventory, r_s: Settings) -> int:
        st = r_s.strategy
        if st.zero_stage in (1, 2) and r_s.ds.contiguous_gradients and r_s.rank.pipeline_stage:
            # DeepSpeed's PipelineEngine reduces the gradients itself after the last micro-batch:
            # stage_1_and_2.py reduce_gradients(pipeline_parallel=True) appends one more reduce bucket of
            # reduce_bucket_size elements to the ipg buffers ("with PP we must create ipg buffer, since backward
            # is handled outside zero"), released at the step; counted through the step (an upper bound: it is
            # made after the last backward). Measured on CPU, pp 2, default buckets: -48.8% without it.
            return r_s.ds.reduce_bucket_size * r_s.recipe.grad_bytes
        if r_s.parallel is not None or st.framework != "fsdp2" or not st.shard_grads or r_s.grad_accum == 1:
            return 0
        rb = r_s.recipe.reduced_grad_bytes
        whole = rb * r_inv.trainable_params
        return max(whole - _fixed(r_inv, r_s).grads[Phase.FORWARD], 0)

    def _embedding_whole(self, r_inv: ParamInventory) -> int:
        """Under DTensor tensor parallelism the vocabulary-parallel embedding's gradient comes out whole: DTensor has
        no row-wise strategy for embedding_dense_backward (torch/distributed/tensor/_ops/_embedding_ops.py: colwise,
        batch-sharded and partial only), so each TP rank computes the full [vocab, hidden] gradient, and FSDP2's
        unsharded accumulator under pipelining keeps it (measured: tp 2 x pp 2, 2,097,152 B where the local rows
        are 1,048,576). The elements beyond the rank's rows."""
        p = self.settings.parallel
        if p.tp == 1 or self.name != "torchtitan":
            return 0
        vocab = self.inventory.dims.get("vocab_size")
        return sum(
            (vocab - t.shape[0]) * (t.numel // t.shape[0]) for t in r_inv.tensors
            if t.category == "embedding" and t.shape and vocab and t.shape[0] < vocab and t.trainable)

    @staticmethod
    def _unsharded(r_inv: ParamInventory, r_s: Settings) -> int:
        from memplan.settings import reshard_after_forward

        st = r_s.strategy
        if st.framework != "fsdp2" or not st.shard_params or r_s.grad_accum == 1 or \
                reshard_after_forward(r_s) is False:
            return 0
        return r_s.recipe.grad_bytes * sum(t.numel for t in r_inv.tensors if t.block)

    def at(self, i: int) -> list[Settings]:
        """Pipeline rank i's settings (cached): see _at_rank."""
        hit = self._at.get(i)
        if hit is None:
            hit = self._at[i] = self._at_rank(i)
        return hit

    def _at_rank(self, i: int) -> list[Settings]:
        """Pipeline rank i's settings: one, or
        where every micro-batch's forward runs before the first backward (GPipe; 1F1B with no more micro-batches
        than the rank holds in flight), the two moments that can peak: the first backward, with every
        micro-batch in flight and no gradient accumulated yet, and the second, one micro-batch fewer and the
        gradients accumulated; a rank of several stages, its backwards that can peak (Layout.peak_moments)."""
        from memplan import parallel as par

        share, r_inv, r_s = self.ranks[i]
        buffers = par.recv_buffers(self.inventory.dims, self.settings.parallel, share, self.settings.grad_accum,
                                   self.settings.seq_len // self.settings.parallel.cp, self.settings.recipe,
                                   self.name)
        one = replace(r_s, rank=replace(r_s.rank, pipeline_buffer_bytes=buffers))
        m = r_s.grad_accum
        if self.settings.parallel.pp == 1:
            # no pipeline: the micro-batches run one after the other as in a data-parallel job (FSDP2 reduces each
            # one's gradients; the engine accumulates them as it does there)
            return [one]
        prof = r_s.activation_profile
        if m == 1:
            return [one]
        moments = self.peak_moments[i]
        if moments is not None and r_s.strategy.framework == "fsdp2" and r_s.rank.pipeline_stage:
            # a rank of several stages: each backward that can peak, with the accumulators of the stages that ran
            # a backward before it (each FSDPParamGroup accumulates its own parameters' gradients from its first
            # post-backward; measured on the harness, looped-BFS pp 2: +15% when every stage's were counted from
            # the second backward on). A stage's first backward makes its accumulators as the first backward of a
            # step makes its gradients (grad_accum 1), beside the other stages' accumulators; a later one adds
            # into them (the step with gradients accumulated: its reduced shards, then the rest of the
            # accumulators of the stages that have them, fewer than the shards where those are not all)
            shards = _fixed(r_inv, r_s).grads[Phase.FORWARD]
            unsharded = self.unsharded[i]
            rb = r_s.recipe.reduced_grad_bytes
            whole = self._embedding_whole(r_inv)
            out = []
            for pv, params, emb, again in moments:
                held = rb * (params + whole * emb) + (unsharded if params else 0)
                out.append(replace(one, activation_profile=pv,
                                   rank=replace(one.rank, pipeline_accumulator_bytes=held - shards)) if again else
                           replace(one, grad_accum=1, activation_profile=pv,
                                   rank=replace(one.rank, pipeline_accumulator_bytes=held)))
            return out
        if moments is not None and r_s.strategy.name == "ddp" and r_s.rank.pipeline_stage:
            # DDP: the stages' gradients in param.grad, made at each parameter's first backward of the step and
            # accumulated into under no_sync (PipelineStage.backward_maybe_with_nosync): none before the first
            # backward, every parameter's kept (grad_accum m) once a stage has run one (a bound where only some
            # stages have)
            return [replace(one, activation_profile=pv, grad_accum=m if params else 1) for pv, params, _, _ in moments]
        # FSDP2 under pipelining accumulates each micro-batch's gradients unsharded and reduces them once, after
        # the last: PipelineStage.backward_maybe_with_nosync sets set_requires_gradient_sync(False) and
        # set_reshard_after_backward(False) on every backward but the last (torch/distributed/pipelining/
        # stage.py), so FSDPParam keeps an unsharded accumulator in the reduce dtype (fp32 under fsdp-bf16;
        # measured: 3,164,160 B per block of 791,040 parameters) where a synced step keeps the reduced shard
        accumulators = self._accumulators(r_inv, r_s)  # FSDP2's unsharded accumulators beyond the reduced shards
        if r_s.strategy.framework == "fsdp2" and r_s.rank.pipeline_stage:
            accumulators += r_s.recipe.reduced_grad_bytes * self._embedding_whole(r_inv)
        acc = replace(one, rank=replace(one.rank, pipeline_accumulator_bytes=accumulators))
        # the backwards with no forward between them (GPipe's after the first; 1F1B's cooldown on ranks holding
        # more than one micro-batch): FSDP2 does not reshard after a backward under pipelining
        # (set_reshard_after_backward(False)), so every block stays unsharded through them, one micro-batch fewer
        # in flight each time
        unsharded = self.unsharded[i]
        later = replace(acc, rank=replace(acc.rank, pipeline_accumulator_bytes=accumulators + unsharded),
                        activation_profile=prof.fewer())
        if prof.held < m:
            return [acc, later] if prof.held > 1 and unsharded else [acc]
        return [replace(one, grad_accum=1), later]

    def report(self) -> dict[str, Any]:
        """The layout and every pipeline rank's figures (the JSON's "parallel")."""
        p = self.settings.parallel
        return {"layout": self.name, "tp": p.tp, "pp": p.pp, "dp": self.dp // p.cp, "cp": p.cp, "sp": p.sp,
                "ep": p.ep,
                "efsdp": self.dp * p.tp // p.ep,
                "virtual_stages": p.virtual if p.multi_stage and p.pp > 1 else 1,
                "schedule": p.schedule if p.pp > 1 else None, "micro_batches": self.settings.grad_accum,
                "worst_pipeline_rank": self.worst,
                "ranks": [{"pipeline_rank": share.rank, "holds": share.describe(),
                           "blocks": list(share.blocks), "params": r_inv.num_params,
                           "micro_batches_in_flight": share.in_flight,
                           "peak_bytes": plan.peak_bytes, "peak_phase": plan.peak.name,
                           "required_bytes": plan.required_bytes, "required_exact": plan.bounded is None,
                           **{k: getattr(plan.peak, k) for k in CATEGORY_KEYS}}
                          for (share, r_inv, _), plan in zip(self.ranks, self.plans)]}


def _chunk_tensors(r_inv: ParamInventory, chunks: tuple[Any, ...]) -> list[list[Any]]:
    """Each of a pipeline rank's stages' tensors: its blocks (the rank's blocks in order, the stages' in turn), the
    embedding with the model's first stage, the final norm and head with its last (frameworks/pipeline_replay.py
    stage_tensors, which the rank's replay walks)."""
    from types import SimpleNamespace

    from memplan.frameworks.pipeline_replay import stage_tensors

    return stage_tensors(r_inv, tuple(SimpleNamespace(layers=len(c.layers), first=c.first, last=c.last)
                                      for c in chunks))


_LAYOUTS: dict[tuple[int, int, int], Layout] = {}


def layout(inv: ParamInventory, s: Settings) -> Layout:
    """The pipeline ranks' shares of this job (cached: the planner and the micro-batch search ask again)."""
    key = (id(inv), hash(repr(replace(s, activation_profile=None, micro_batch=1,
                                      parallel=replace(s.parallel, profiles=None)))), id(s.parallel.profiles))
    hit = _LAYOUTS.get(key)
    if hit is None or hit.inventory is not inv:
        if len(_LAYOUTS) > 64:
            _LAYOUTS.clear()
        hit = _LAYOUTS[key] = Layout(inv, s)
    return hit


def _parallel(s: Settings) -> bool:
    return s.parallel is not None and s.parallel.active


def _estimate_layout(inv: ParamInventory, s: Settings, reserved_limit: int | None) -> Plan:
    """The most loaded pipeline rank's Plan (by the bytes the fit verdict needs), every rank's in its layout."""
    lay = layout(inv, s)
    plans = tuple(max((estimate(r_inv, replace(v, micro_batch=s.micro_batch), reserved_limit) for v in lay.at(i)),
                      key=lambda p: (p.required_bytes, p.peak_bytes))
                  for i, (_, r_inv, _) in enumerate(lay.ranks))
    worst = max(range(len(plans)), key=lambda i: (plans[i].required_bytes, plans[i].peak_bytes))
    view = Layout.__new__(Layout)
    for k in Layout.__slots__:
        setattr(view, k, getattr(lay, k))
    view.plans, view.worst = plans, worst
    # a rank whose figure is only a bound from below leaves the job's a bound too (the worst may be that rank)
    bounded = next((f"pipeline rank {i}: {p.bounded}" if len(plans) > 1 else p.bounded
                    for i, p in enumerate(plans) if p.bounded), None)
    return replace(plans[worst], layout=view, bounded=bounded,
                   communication=with_model_parallel(plans[worst].communication, view, worst))


def with_model_parallel(volume: dict[str, Any], lay: Layout, rank: int) -> dict[str, Any]:
    """A data-parallel group's collectives (comm.communication) with pipeline rank ``rank``'s tensor- and
    pipeline-parallel traffic added."""
    out = dict(volume)
    extra = model_parallel(lay, rank)
    out["collectives"] = list(out["collectives"]) + extra
    for x in extra:
        key = "inter_node_bytes" if x["network"] == "inter-node" else "intra_node_bytes"
        out[key] += x["bytes_per_gpu"]
        out["total_bytes"] += x["bytes_per_gpu"]
    return out


def job_communication(inv: ParamInventory, s: Settings) -> dict[str, Any]:
    """The communication per GPU per optimizer step of any job, without estimating it: under model parallelism
    the first pipeline rank's (it holds the most micro-batches in flight), its data-parallel collectives with its
    tensor- and pipeline-parallel traffic."""
    if s.parallel is None or not s.parallel.active:
        return communication(inv, s)
    lay = layout(inv, s)
    _, r_inv, r_s = lay.ranks[0]
    return with_model_parallel(communication(r_inv, r_s), lay, 0)
