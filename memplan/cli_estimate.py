"""What `memplan estimate` and `memplan check` share: the command's options, with the job's own files
(memplan/jobfiles.py) filling what the command line did not give, resolved into Settings, estimated, explained
and, when the job does not fit, the single changes that would (memplan/advice.py). Only the CLI uses it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan import cli_options as O


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
    out = dict(given)
    used: dict[str, str] = {}
    for k, v in values.items():
        strategy_given = k in ("stage", "strategy") and ({"stage", "strategy"} & explicit)
        if k in explicit or strategy_given:
            if not strategy_given and given[k] != v:
                notes.append(f"{k}: command line {given[k]!r} overrides {sources[k]} {v!r}")
            elif strategy_given:
                notes.append(f"strategy: the command line's overrides {sources[k]} {k} {v!r}")
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
                notes.append(f"precision: command line {given['precision']!r} overrides {sources['_mixed']} "
                             f"{recipe!r}")
        else:
            if "precision" in used and out["precision"] != recipe:
                notes.append(f"precision: {sources['_mixed']} {recipe!r} overrides {used['precision']} "
                             f"{out['precision']!r}")
            out["precision"], used["precision"] = recipe, sources["_mixed"]
    return out, used, notes, [f.path for f in files]


def run(given: dict[str, Any], explicit: set[str], overheads: Any, suggestions: bool = True,
        progress_text: str = "estimating single changes that would fit", max_fraction: float | None = None) -> Estimated:
    """Estimate the job ``given`` (a command's parameters; ``explicit``: those given on the command line);
    ``max_fraction``: suggestions fit that share of the GPU (memplan check)."""
    from memplan import accounting, advice, options, progress
    from memplan.explain import explain
    from memplan.model import sources
    from memplan.report import plan_report

    given, file_sources, file_notes, files = _with_files(given, explicit)
    src = sources.resolve(given["model"])
    inv = sources.build_inventory(src, builder=given["builder"])
    config = sources.trace_config(src, inv)
    spec = O.lora_spec(given, file_notes)
    if spec is not None:  # the adapters as PEFT adds them; the traced step adds the same (options._with_lora)
        from memplan.model import lora

        inv = lora.apply(inv, spec)

    def resolve(changes: dict[str, Any]) -> Any:
        g = {**given, **changes}
        return options.resolve(
            inv, config=config, activations=g["activations"], cpu_isa=g["cpu_isa"], gpus=g["gpus"],
            gpus_per_node=g["gpus_per_node"], stage=g["stage"], strategy=g["strategy"], precision=g["precision"],
            optimizer=g["optimizer"], optimizer_impl=g["optimizer_impl"], micro_batch=g["micro_batch"],
            seq_len=g["seq_len"], grad_accum=g["grad_accum"], recompute=g["recompute"], attention=g["attention"],
            gpu=g["gpu"], gpu_memory_size=g["gpu_memory"], device=g["device"], deepspeed=g["deepspeed"],
            allocator_conf=g["allocator_conf"], host_memory_size=g["host_memory"], pin_memory=g["pin_memory"],
            ds_overrides=O.ds_overrides(g), torch_overrides=O.torch_overrides(g),
            horovod_overrides=O.horovod_overrides(g), overhead_overrides=overheads(g), lora=spec,
            parallel=O.parallel_of(g), trace=g.get("_trace", True))

    resolved = resolve({})
    plan = accounting.estimate(inv, resolved.settings)
    srcs = dict(resolved.sources)
    for k, path in file_sources.items():
        srcs["strategy" if k == "stage" else k] = path
    rep = plan_report(plan, srcs, tuple(file_notes) + tuple(resolved.notes))
    ex = explain(plan)
    if given.get("explain"):
        rep["explain"] = ex
    if suggestions:
        with progress.task(progress_text):
            cap = plan.settings.cluster.gpu_memory_bytes
            limit = int(cap * max_fraction) if max_fraction is not None and cap else None
            found = advice.suggest(plan, lambda ch: resolve(ch).settings, limit)
        if found is not None:
            rep["suggestions"] = found
    return Estimated(plan, rep, ex, files)
