"""What `memplan estimate`, `check` and `plan` share: the command's options, with the job's own files
(memplan/jobfiles.py) filling what the command line did not give, resolved into Settings, estimated, explained
and, when the job does not fit, the single changes that would (memplan/advice.py). Only the CLI uses it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any



@dataclass
class Estimated:
    plan: Any
    report: dict[str, Any]
    explained: dict[str, Any]
    files: list[str]  #: the job files read


def inventory(request: Any, notes: list[str] | None = None) -> tuple[Any, Any, Any]:
    """The request with its LoRA adapter made (request.Adapters.with_adapter), the model's inventory with that
    adapter as PEFT adds it (the traced step adds the same), and the config to trace."""
    from memplan.model import sources

    request = replace(request, adapters=request.adapters.with_adapter(notes))
    src = sources.with_task(sources.resolve(request.model.model), request.model.task)
    from memplan import options

    options.config_checks(src.config, request)  # refused in milliseconds, not after building the model
    inv = sources.build_inventory(src, builder=request.model.builder)
    config = sources.trace_config(src, inv)
    if request.adapters.spec is not None:
        from memplan.model import lora

        inv = lora.apply(inv, request.adapters.spec)
    from memplan.model import freeze

    return request, freeze.for_request(inv, request), config


def plan(base: Any, space: Any, plot: str | None, flags: list[str]) -> tuple[dict[str, Any], Any]:
    """`memplan plan`: the search over ``space`` (request.SearchSpace) for the job ``base``, drawn to ``plot``;
    its report (whose command carries ``flags``, the job's options as given) and the recommended Settings."""
    from memplan import accounting, planner, progress
    from memplan.report import search_report

    base, inv, config = inventory(base)
    with progress.task(f"searching layouts for {inv.model_name} (strategies x recompute x GPU counts)"):
        found = planner.search(inv, base, space, config=config)
    best = planner.best_settings(found)
    if plot:
        from memplan import plot as P

        P.draw(plot, P.bars_across_candidates(inv, found), found.gpu_memory_bytes,
               f"{inv.model_name}: the candidates at {found.gpus or found.max_gpus} GPUs", "candidate")
    rep = search_report(found, inv, None if best is None else accounting.estimate(inv, best),
                        lambda c: planner.command_line(base.model.model, found, flags, c))
    return rep, best


def run(request: Any, *, with_explain: bool = False, suggestions: bool = True,
        progress_text: str = "estimating single changes that would fit", max_fraction: float | None = None) -> Estimated:
    """Estimate the job ``request`` (memplan/request.py JobRequest, as the command gave it: options.resolve merges
    its files in); ``max_fraction``: suggestions fit that share of the GPU (memplan check)."""
    from memplan import accounting, advice, options, progress
    from memplan.explain import explain
    from memplan.report import plan_report

    notes: list[str] = []
    request, inv, config = inventory(request, notes)

    def job_with(changes: dict[str, Any]) -> tuple[Any, Any]:
        # a change as the printed command runs it: given on the command line, the job's files filling the rest (a
        # strategy of another framework takes the files' mixed precision in its own recipe: jobfiles.precision_for);
        # a change of the adapter (QLoRA) makes its own inventory, as the command does
        changes = dict(changes)
        trace = changes.pop("_trace", True)
        req, inv_ch, config_ch = request, inv, config
        if changes:
            req = request.changed(**changes)
            if any(request.part_of(k) == "adapters" for k in changes):
                req, inv_ch, config_ch = inventory(req)
        return inv_ch, options.resolve(inv_ch, req, config=config_ch, trace=trace)

    def changed_job(changes: dict[str, Any]) -> tuple[Any, Any]:
        inv_ch, res = job_with(changes)
        return inv_ch, res.settings

    _, resolved = job_with({})
    gpn, gpus = resolved.settings.cluster.gpus_per_node, resolved.settings.cluster.gpus
    if 1 <= gpus < gpn:  # a real setup (plan's rows print it), given or from the job's files: said
        notes.append(f"{gpus} GPU(s) on part of one {gpn}-GPU node: {gpus} ranks, all within the node")
    plan = accounting.estimate(inv, resolved.settings)
    rep = plan_report(plan, dict(resolved.sources), tuple(notes) + tuple(resolved.notes))
    ex = explain(plan)
    if with_explain:
        rep["explain"] = ex
    if suggestions:
        with progress.task(progress_text):
            cap = plan.settings.cluster.gpu_memory_bytes
            limit = int(cap * max_fraction) if max_fraction is not None and cap else None
            found = advice.suggest(plan, changed_job, limit)
        if found is not None:
            rep["suggestions"] = found
    return Estimated(plan, rep, ex, list(resolved.files))
