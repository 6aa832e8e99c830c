"""What `memplan estimate` and `memplan check` share: the command's options, with the job's own files
(memplan/jobfiles.py) filling what the command line did not give, resolved into Settings, estimated, explained
and, when the job does not fit, the single changes that would (memplan/advice.py). Only the CLI uses it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from memplan.inputs import quote


@dataclass
class Estimated:
    plan: Any
    report: dict[str, Any]
    explained: dict[str, Any]
    files: list[str]  #: the job files read


def defaults(fn: Any) -> dict[str, Any]:
    """A typer command's parameters and their defaults (what it receives when nothing is given)."""
    import inspect

    out = {}
    for name, p in inspect.signature(fn).parameters.items():
        d = p.default
        out[name] = getattr(d, "default", d) if type(d).__name__ in ("OptionInfo", "ArgumentInfo") else d
    return out


def _with_files(given: dict[str, Any], explicit: set[str]) -> tuple[dict[str, Any], dict[str, str], list[str],
                                                                    list[str]]:
    """The options with the job files' values where the command line gave none; the files' sources; notes;
    the files read."""
    from memplan import jobfiles

    files = []
    if given.get("accelerate_config"):
        files.append(jobfiles.read_accelerate(given["accelerate_config"]))
    if given.get("training_args"):
        files.append(jobfiles.read_training_args(given["training_args"]))
    values, sources, notes = jobfiles.merge(files)
    values = _framework_of_command_line(given, explicit, values, sources, notes)
    out = dict(given)
    used: dict[str, str] = {}
    for k, v in values.items():
        strategy_given = k in ("stage", "strategy") and ({"stage", "strategy"} & explicit)
        if k in explicit or strategy_given:
            if not strategy_given and given[k] != v:
                notes.append(f"{k}: command line {quote(given[k])} overrides {sources[k]} {quote(v)}")
            elif strategy_given:
                notes.append(f"strategy: the command line's overrides {sources[k]} {k} {quote(v)}")
            continue
        out[k], used[k] = v, sources[k]
    if "stage" in used:
        out["strategy"] = None
    mixed = out.pop("_mixed", None)
    used.pop("_mixed", None)
    if mixed is not None:  # the Trainer's bf16/fp16, under the framework the job runs with
        recipe = jobfiles.precision_for({**out, "_mixed": mixed})
        if "precision" in explicit:
            if given["precision"] != recipe:
                notes.append(f"precision: command line {quote(given['precision'])} overrides {sources['_mixed']} "
                             f"{quote(recipe)}")
        else:
            if "precision" in used and out["precision"] != recipe:
                notes.append(f"precision: {sources['_mixed']} {quote(recipe)} overrides {used['precision']} "
                             f"{quote(out['precision'])}")
            out["precision"], used["precision"] = recipe, sources["_mixed"]
    return out, used, notes, [f.path for f in files]


#: the settings a job file gives that belong to one framework (memplan/jobfiles.py): dropped, with a note, where the
#: command line's --stage / --strategy runs the job under another framework than the file's
FRAMEWORK_KEYS = {"fsdp": ("fsdp_wrap", "fsdp_version", "cpu_offload", "hsdp_shard_size"),
                  "deepspeed": ("deepspeed", "offload_optimizer", "offload_param")}


def _family(stage: Any, strategy: Any) -> str:
    if stage is not None or str(strategy or "").startswith("zero") and strategy != "zero-optimizer":
        return "deepspeed"
    if str(strategy or "").startswith("fsdp") or strategy == "hsdp":
        return "fsdp"
    return "torch"


def _framework_of_command_line(given: dict[str, Any], explicit: set[str], values: dict[str, Any],
                               sources: dict[str, str], notes: list[str]) -> dict[str, Any]:
    """Where the command line's --stage / --strategy runs the job under another framework than its files', the
    files' settings of their framework no longer apply (an Accelerate FSDP config's wrap policy under --stage 3):
    they are dropped with a note, and a precision the files gave follows the command line's framework with the
    same mixed precision (jobfiles.precision_for)."""
    from memplan import jobfiles

    if not ({"stage", "strategy"} & explicit) or not ({"stage", "strategy", "deepspeed"} & set(values)):
        return values
    theirs = _family(values.get("stage"), values.get("strategy")) if "deepspeed" not in values else "deepspeed"
    ours = _family(given.get("stage") if "stage" in explicit else None,
                   given.get("strategy") if "strategy" in explicit else None)
    if theirs == ours:
        return values
    out = dict(values)
    dropped = [k for k in FRAMEWORK_KEYS.get(theirs, ()) if k in out]
    for k in dropped:
        out.pop(k)
    if dropped:
        where = sorted({sources[k] for k in dropped})
        notes.append(f"{', '.join(where)}: its {theirs} settings ({', '.join(dropped)}) do not apply to the command "
                     f"line's {ours} strategy; left out")
    if "precision" in out and "_mixed" not in out:
        mixed = {"fp32": "no", "deepspeed-fp16": "fp16"}.get(str(out["precision"]), "bf16")
        recipe = jobfiles.precision_for({"stage": given.get("stage") if "stage" in explicit else None,
                                         "strategy": given.get("strategy") if "strategy" in explicit else None,
                                         "_mixed": mixed})
        if recipe != out["precision"]:
            notes.append(f"precision: {sources['precision']}'s {quote(out['precision'])} is {theirs}'s; the "
                         f"command line's {ours} strategy runs the same mixed precision as {quote(recipe)}")
            out["precision"] = recipe
    return out


def run(request: Any, explicit: set[str], *, with_explain: bool = False, suggestions: bool = True,
        progress_text: str = "estimating single changes that would fit", max_fraction: float | None = None) -> Estimated:
    """Estimate the job ``request`` (memplan/request.py JobRequest, as the command gave it; ``explicit``: the
    fields given on the command line) with its files' values merged in; ``max_fraction``: suggestions fit that
    share of the GPU (memplan check)."""
    from memplan import accounting, advice, options, progress
    from memplan.explain import explain
    from memplan.model import sources
    from memplan.report import plan_report
    from memplan.request import JobRequest

    raw = request.flat()
    given, file_sources, file_notes, files = _with_files(raw, explicit)
    asked = JobRequest.of(**given)
    asked = asked.with_sources({**{k: "command line" for k in explicit}, **file_sources})
    asked = replace(asked, adapters=asked.adapters.with_adapter(file_notes))
    src = sources.with_task(sources.resolve(asked.model.model), asked.model.task)
    inv = sources.build_inventory(src, builder=asked.model.builder)
    config = sources.trace_config(src, inv)
    if asked.adapters.spec is not None:  # the adapters as PEFT adds them; the traced step adds the same
        from memplan.model import lora

        inv = lora.apply(inv, asked.adapters.spec)

    def resolve(changes: dict[str, Any]) -> Any:
        changes = dict(changes)
        trace = changes.pop("_trace", True)
        job = asked.changed(**changes)
        if files and changes:
            # a change on top of the job's files, as the printed command runs it: the change given on the command
            # line, the files filling the rest (a strategy of another framework takes the files' mixed precision
            # in its own recipe: jobfiles.precision_for, _framework_of_command_line)
            merged, used = _with_files({**raw, **changes}, explicit | set(changes))[:2]
            job = replace(JobRequest.of(**merged), adapters=asked.adapters).with_sources(used)
        return options.resolve(inv, job, config=config, trace=trace)

    resolved = resolve({})
    gpn, gpus = asked.cluster.gpus_per_node, asked.cluster.gpus
    if gpn is not None and gpus is not None and 1 <= gpus < gpn:  # a real setup (plan's rows print it): said
        file_notes.append(f"{gpus} GPU(s) on part of one {gpn}-GPU node: {gpus} ranks, all within the node")
    plan = accounting.estimate(inv, resolved.settings)
    rep = plan_report(plan, dict(resolved.sources), tuple(file_notes) + tuple(resolved.notes))
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
    return Estimated(plan, rep, ex, files)
