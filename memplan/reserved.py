"""The reserved peak: the caching allocator (memplan/allocator.py) replayed over the run's allocations.

A job runs out of memory when PyTorch's caching allocator cannot reserve a new segment, so the fit verdict needs
``torch.cuda.max_memory_reserved``, which the allocated peak does not give. Each framework writes down the order
in which a run allocates and frees (memplan/frameworks/*_replay.py, named by its memory model), and this module
replays it with the shared machinery (memplan/replay.py):

1. the model is built on the device, one parameter after another in module order (``from_config`` under
   ``torch.device("cuda")``, or ``model.to("cuda")``: Module._apply moves them in that order);
2. the framework's setup: DDP's broadcast of the module states and its Reducer buckets, FSDP2's sharded
   parameters, DeepSpeed's flat groups, master partitions and buffers;
3. training steps: the traced step's storages (tracing's alloc_events: every storage the micro-step creates and
   when it dies, repeated to the model's depth), with the framework's own moments around it (gradients kept,
   reduced or freed; gathers), then the optimizer step (states created at the first step, the foreach
   implementation's temporaries) and ``zero_grad``.

Steps repeat until one reserves nothing new (a run's reserved memory only grows without ``empty_cache``);
``max_memory_reserved`` is the largest reserved total seen. Pure Python, no torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Any

from memplan import frameworks
from memplan.allocator import AllocatorConfig, OutOfMemory
from memplan.replay import OverLimit, Reserved, Run, bucket_assignment, step_events  # noqa: F401  (the API)


def _replayer(s: Any) -> Any:
    if s.rank.pipeline_stage:
        return importlib.import_module("memplan.frameworks.pipeline_replay")  # a pipeline rank's action list
    name = frameworks.model(s.strategy.memory_model).replay
    return importlib.import_module(name) if name else None


def why_not(s: Any, inv: Any = None) -> str | None:
    """Why the reserved peak cannot be replayed for these settings (None: it can); ``inv``: the rank's inventory,
    where it decides."""
    if s.cluster.device != "cuda":
        return "device cpu (no caching allocator)"
    prof = _replayed_profile(s)
    if inv is not None and any(t.shard_split > 1 for t in inv.tensors):
        # the experts units act where the traced step marks their module (replay.py): a pipeline rank's every
        # stage's step
        if getattr(prof, "actions", None):
            from memplan.frameworks.pipeline_replay import stage_tensors

            steps = [x.profile for x, ts in zip(prof.stages, stage_tensors(inv, prof.stages))
                     if any(t.shard_split > 1 for t in ts)]
        else:
            steps = [prof]
        for step in steps:
            ev = (getattr(step, "data", None) or {}).get("alloc_events") or {}
            if "xfs" not in ev:
                return "expert parallelism: the traced step does not mark where the experts modules run"
    if s.rank.pipeline_stage:
        from memplan.frameworks import pipeline_replay

        why = pipeline_replay.why_not(s)
        return None if why is None else f"pipeline parallelism: {why}"
    if getattr(prof, "inner", None) is not None:
        return "micro-batches in flight on one rank are not replayed yet"
    data = getattr(prof, "data", None)
    if not data or not data.get("alloc_events"):
        return "no traced step (analytic activations, or a profile traced before allocations were recorded)"
    if not data["alloc_events"].get("fs"):
        return "the traced step has no blocks (a module without a stack of blocks: nothing to repeat to its depth)"
    mod = _replayer(s)
    if mod is None:
        return f"{s.strategy.framework} setup not modelled yet"
    return mod.why_not(s) if hasattr(mod, "why_not") else None


def _replayed_profile(s: Any) -> Any:
    """The traced step a replay runs. A tensor-parallel rank without pipelining (memplan/accounting.py Layout: one
    micro-batch in flight) runs its own share traced as a model of its own (HeldProfile.inner); accounting.estimate
    then stands the replay's allocator overhead on the rank's own allocated peak (Reserved.moved_to), which
    DTensor's loss_parallel raises and sequence parallelism lowers. Not measured on a GPU (one rank per run there).
    A pipeline rank (several micro-batches in flight, the stage's own buffers and accumulators) is not replayed:
    its HeldProfile comes back."""
    prof = s.activation_profile
    inner = getattr(prof, "inner", None)
    if inner is None or prof.held != 1 or prof.others or s.rank.pipeline_stage:
        return prof
    return inner


def _profile_id(prof: Any) -> Any:
    """What a replay's traced steps are, for its cache key: the profile's data, or a pipeline rank's stages' and
    schedule."""
    if getattr(prof, "actions", None):
        return (tuple(id(x.profile.data) for x in prof.stages), prof.actions,
                tuple(replace(x, profile=None) for x in prof.stages))
    return id(prof.data)


def _settings_key(s: Any) -> str:
    """The settings a replay depends on: all but the profile, and for a pipeline rank but the engine's own moments
    (accounting.Layout._at_rank's variants of one rank replay the same action list)."""
    if s.rank.pipeline_stage:
        s = replace(s, grad_accum=1, rank=replace(s.rank, pipeline_accumulator_bytes=0))
    return repr(replace(s, activation_profile=None))


#: replays already made in this process, by what they depend on (the planner asks some twice)
_CACHE: dict[tuple[Any, ...], Reserved] = {}
#: replays stopped at a limit, by the same key: their peak is only known to be above it
_PARTIAL: dict[tuple[Any, ...], Reserved] = {}


def predict(inv: Any, s: Any, config: AllocatorConfig | None = None, limit: int | None = None,
            card: int | None = None) -> Reserved | None:
    """The reserved peak of one configuration, or None where why_not(s) says why not. ``limit``: stop once the
    reserved bytes pass it; the answer's peak is then only a bound from below (``complete`` False). ``card``: the
    card's limit on the allocator (capped's device_limit); where ``limit`` is it, one replay under the card
    (_at_card) answers both this and capped()."""
    if why_not(s, inv) is not None:
        return None
    prof = _replayed_profile(s)
    if prof is not s.activation_profile:
        s = replace(s, activation_profile=prof)
        limit = None  # the figure moves afterwards (accounting.estimate): a bound on it says nothing here
    key = (id(inv), _profile_id(prof), _settings_key(s), repr(config))
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    partial = _PARTIAL.get(key)
    if partial is not None and limit is not None and partial.peak_bytes > limit:
        return partial
    if len(_CACHE) > 256:
        _CACHE.clear()
        _PARTIAL.clear()
    if limit is not None and limit == card and config is None:
        at_card = _at_card(inv, s, key, limit)
        if at_card is not None:
            return at_card
    Run.limit = limit
    try:
        hit = _CACHE[key] = _predict(inv, s, config)
    except OverLimit as over:
        bound: Reserved = over.args[0]
        _PARTIAL[key] = bound
        return bound
    finally:
        Run.limit = None
    return hit


def _predict(inv: Any, s: Any, config: AllocatorConfig | None) -> Reserved:
    config = config or AllocatorConfig.parse(s.allocator_conf)
    model, variants = _replayer(s).replay(inv, s, config)
    return _reserved_of(model, variants, config)


def _reserved_of(model: str, variants: dict[str, Any], config: AllocatorConfig) -> Reserved:
    best = max(variants.values(), key=lambda a: (a.peak_reserved, a.steps[-1][0] if a.steps else 0))
    return Reserved(peak_bytes=best.peak_reserved, allocated_bytes=best.steps[-1][0], model=model,
                    variants={k: a.peak_reserved for k, a in variants.items()}, config=config.text,
                    steps=tuple(best.steps))


def _at_card(inv: Any, s: Any, key: tuple[Any, ...], limit: int) -> Reserved | None:
    """A search's question (does the job pass ``limit``, the card's limit on the allocator?) answered by the one
    replay capped() makes under the card, instead of one stopped at the limit and then capped()'s own. Up to the
    first reservation the card refuses (Allocator.over) the two replays make the same decisions: none refused,
    this is the replay without limits, run through; else the one without limits would stop there, with the
    peaks ``over`` records, and the replay goes on under the card for capped(), which finds it in _CAPPED.
    None (the two-replay road) where the two differ before that: expandable segments (pages mapped as they are
    asked for), a memory fraction (garbage collection, a second limit), a tensor-parallel rank's share (capped
    shifts the limit)."""
    config = AllocatorConfig.parse(s.allocator_conf)
    if (config.expandable_segments or config.per_process_memory_fraction < 1.0 or limit <= 0
            or getattr(s.activation_profile, "inner", None) is not None):
        return None
    made: list[Any] = []
    Run.made = made
    try:
        model, variants, hit = _replay_capped(inv, s, config, limit, None, limit, None, 0)
    finally:
        Run.made = None
    overs = [a.over for a in made if a.over is not None]
    if not overs:
        assert variants is not None  # nothing refused: no out-of-memory error
        res = _CACHE[key] = _reserved_of(model, variants, config)
        return res
    _CAPPED[key[:3] + (repr(config), limit, None)] = hit
    _, peak, allocated = min(overs)
    bound = _PARTIAL[key] = Reserved(peak_bytes=peak, allocated_bytes=allocated, model="", variants={}, config="",
                                     complete=False)
    return bound


@dataclass(frozen=True)
class Capped:
    """The replay under the card's limits (allocator.Allocator device_limit, fraction_limit): what PyTorch's caching
    allocator does when a reservation does not fit, flushing its cache and retrying (DeviceCachingAllocator::malloc
    -> alloc_block, release_available_cached_blocks, release_cached_blocks), until the step runs through or
    raises CUDA's out-of-memory error."""

    fits: bool  #: the replay ran through: no out-of-memory error
    peak_bytes: int  #: the reserved peak under the limits (on out of memory: where it stopped)
    #: cache flushes (synchronising cudaFree of every free segment, then a retry) in the steady step, and in all
    flushes_per_step: int
    flushes: int
    limit_bytes: int  #: the most the allocator could hold: the smaller of the two limits below
    device_limit_bytes: int  #: the card less the memory outside the allocator (CUDA context, NCCL)
    fraction_limit_bytes: int | None  #: per_process_memory_fraction x the card's total, where one is set
    failed_request_bytes: int | None = None  #: the request no flush could serve (out of memory)


#: capped replays made in this process, by what they depend on and the limits
_CAPPED: dict[tuple[Any, ...], Capped] = {}


def capped(inv: Any, s: Any, device_limit: int, fraction_limit: int | None, uncapped: Reserved | None = None,
           shift: int = 0) -> Capped | None:
    """The step replayed under the card's limits, or None where why_not(s) says it cannot be replayed.

    ``uncapped``: the replay without limits, where one was made: a peak within both limits means PyTorch never
    reaches them (the same decisions, no flush) unless garbage collection runs (a fraction and a threshold set),
    so no second replay is made. ``shift``: the bytes a tensor-parallel rank's figures stand above its share's
    replay (Reserved.moved_to): the limits are taken that much lower for the replay, its figures moved back."""
    limit = device_limit if fraction_limit is None else min(device_limit, fraction_limit)
    config = AllocatorConfig.parse(s.allocator_conf)
    gc = fraction_limit is not None and config.garbage_collection_threshold > 0
    if uncapped is not None and uncapped.complete and not gc and uncapped.peak_bytes <= limit:
        return Capped(True, uncapped.peak_bytes, 0, 0, limit, device_limit, fraction_limit)
    if why_not(s, inv) is not None:
        return None
    prof = _replayed_profile(s)
    if prof is not s.activation_profile:
        s = replace(s, activation_profile=prof)
    dev = device_limit - shift
    frac = None if fraction_limit is None else fraction_limit - shift
    key = (id(inv), _profile_id(prof), _settings_key(s), repr(config), dev, frac)
    hit = _CAPPED.get(key)
    if hit is None:
        hit = _CAPPED[key] = _replay_capped(inv, s, config, dev, frac, device_limit, fraction_limit, shift)[2]
    return hit


def _replay_capped(inv: Any, s: Any, config: AllocatorConfig, dev: int, frac: int | None, device_limit: int,
                   fraction_limit: int | None, shift: int) -> tuple[str, dict[str, Any] | None, Capped]:
    """The replay under the allocator's limits ``dev`` and ``frac``: (the framework sequence, the variants'
    allocators (None on out of memory), the Capped answer, its figures ``shift`` up)."""
    limit = device_limit if fraction_limit is None else min(device_limit, fraction_limit)
    if len(_CAPPED) > 256:
        _CAPPED.clear()
    Run.limit, Run.device_limit, Run.fraction_limit = None, max(dev, 0), None if frac is None else max(frac, 0)
    try:
        model, variants = _replayer(s).replay(inv, s, config)
        worst = max(variants.values(), key=lambda a: (a.retries, a.peak_reserved))
        steady = worst.step_retries[-1] - (worst.step_retries[-2] if len(worst.step_retries) > 1 else 0)
        return model, variants, Capped(True, max(a.peak_reserved for a in variants.values()) + shift, steady,
                                       worst.retries, limit, device_limit, fraction_limit)
    except OutOfMemory as oom:
        a = oom.allocator
        return "", None, Capped(False, a.peak_reserved + shift, 0, a.retries, limit, device_limit, fraction_limit,
                                failed_request_bytes=oom.size)
    finally:
        Run.device_limit = Run.fraction_limit = None
