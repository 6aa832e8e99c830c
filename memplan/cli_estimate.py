"""What `memplan estimate` and `memplan check` share: the command's options, with the job's own files
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


def run(request: Any, *, with_explain: bool = False, suggestions: bool = True,
        progress_text: str = "estimating single changes that would fit", max_fraction: float | None = None) -> Estimated:
    """Estimate the job ``request`` (memplan/request.py JobRequest, as the command gave it: options.resolve merges
    its files in); ``max_fraction``: suggestions fit that share of the GPU (memplan check)."""
    from memplan import accounting, advice, options, progress
    from memplan.explain import explain
    from memplan.model import sources
    from memplan.report import plan_report

    request = replace(request, adapters=request.adapters.with_adapter(notes := []))
    src = sources.with_task(sources.resolve(request.model.model), request.model.task)
    inv = sources.build_inventory(src, builder=request.model.builder)
    config = sources.trace_config(src, inv)
    if request.adapters.spec is not None:  # the adapters as PEFT adds them; the traced step adds the same
        from memplan.model import lora

        inv = lora.apply(inv, request.adapters.spec)

    def resolve(changes: dict[str, Any]) -> Any:
        # a change as the printed command runs it: given on the command line, the job's files filling the rest (a
        # strategy of another framework takes the files' mixed precision in its own recipe: jobfiles.precision_for)
        changes = dict(changes)
        trace = changes.pop("_trace", True)
        return options.resolve(inv, request.changed(**changes) if changes else request, config=config, trace=trace)

    resolved = resolve({})
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
            found = advice.suggest(plan, lambda ch: resolve(ch).settings, limit)
        if found is not None:
            rep["suggestions"] = found
    return Estimated(plan, rep, ex, list(resolved.files))
