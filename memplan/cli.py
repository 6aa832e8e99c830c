"""Command line: thin typer commands (parse, call, render). The only module that imports typer and rich.

User errors (MemplanError) become ``Error: <message>`` on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any, Optional

import typer

from memplan import __version__
from memplan import cli_options as O
from memplan import cli_render as R
from memplan.errors import MemplanError
from memplan.units import fmt_bytes

app = typer.Typer(add_completion=True, no_args_is_help=True, rich_markup_mode=None,
                  help="Per-GPU memory of distributed training jobs, before you launch them. "
                       "Sizes are shown in binary units (GiB = 2^30 bytes).")


@app.command()
def presets(as_json: bool = typer.Option(False, "--json", help="Print JSON on stdout.")) -> None:
    """List the shipped model presets and GPU presets.

    Example: memplan presets --json
    """
    from memplan.model import sources

    models = []
    for name in sources.preset_names():
        src = sources.resolve(name)
        inv = sources.build_inventory(src)
        aliases = sorted(a for a, c in sources.PRESET_ALIASES.items() if c == name)
        models.append({"name": name, "aliases": aliases, "model_type": src.config.get("model_type"),
                       "num_params": inv.num_params, "name_or_path": src.config.get("_name_or_path")})
    gpus = [{**g.to_json(), "capacity_bytes": g.capacity[0], "capacity_as": g.capacity[1]}
            for g in sources.gpu_presets().values()]
    if as_json:
        R.emit_json({"schema_version": 1, "models": models, "gpus": gpus})
        return
    c = R.console()
    c.print(R.table("Model presets (real config.json files)", [("preset", "left"), ("aliases", "left"),
                                                             ("model_type", "left"), ("parameters", "right")],
                   [[m["name"], ", ".join(m["aliases"]), m["model_type"], f"{m['num_params']:,}"] for m in models]))
    c.print(R.table("GPU presets (capacity: what the verdict compares with, as torch reports it where measured, "
                    "else the driver's memory.total)",
                    [("gpu", "left"), ("device", "left"), ("capacity", "right"), ("bytes", "right"), ("as", "left"),
                     ("driver's total", "right")],
                    [[g["id"], f"{g['name']} ({g['nominal']})", fmt_bytes(g["capacity_bytes"]),
                      f"{g['capacity_bytes']:,}", g["capacity_as"], f"{g['usable_bytes']:,}"] for g in gpus]))


@app.command()
def inspect(
    model: str = typer.Argument(..., help="Preset name, config.json, model directory, cached repo id, or pkg.mod:fn."),
    builder: str = typer.Option("auto", help="auto | analytic (from config, no torch) | meta (instantiate on meta)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON on stdout."),
) -> None:
    """Parameters of a model: counts, bytes per dtype, categories, blocks, largest block and tensor, ties.

    Example: memplan inspect ./my-model-dir --json
    """
    from memplan.model import sources
    from memplan.report import inspect_report

    inv = sources.build_inventory(sources.resolve(model), builder=builder)
    rep = inspect_report(inv)
    if as_json:
        R.emit_json(rep)
        return
    c = R.console()
    m = rep["model"]
    c.print(f"[bold]{m['name']}[/bold]  {m['num_params']:,} parameters  ({m['family']}, {m['source']}, "
            f"builder: {m['builder']})")
    c.print(R.table("Stored bytes by dtype", [("dtype", "left"), ("bytes", "right"), ("size", "right")],
                   [[d, f"{b:,}", fmt_bytes(b)] for d, b in rep["bytes_by_dtype"].items()]))
    total = m["num_params"]
    c.print(R.table("Parameters by category", [("category", "left"), ("parameters", "right"), ("share", "right")],
                   [[k, f"{v:,}", f"{100 * v / total:.2f}%"] for k, v in rep["params_by_category"].items()]))
    lb, lt = rep["largest_block"], rep["largest_tensor"]
    c.print(f"blocks (wrapped units): {rep['num_blocks']}; root (outside blocks): {rep['root_block_params']:,} params")
    if lb:
        c.print(f"largest block: {lb['name']} ({lb['num_params']:,} params, {lb['num_tensors']} tensors)")
    c.print(f"largest tensor: {lt['name']} {tuple(lt['shape'])} ({lt['num_params']:,} params)")
    for t in rep["tied"]:
        c.print(f"tied: {t['name']} = {', '.join(t['aliases'])} (counted once)")
    for n in rep["notes"]:
        c.print(f"note: {n}")


@app.command()
@O.request_options(*O.ALL_PARTS)
def estimate(
    ctx: typer.Context,
    model: O.Model,
    plot: O.Plot = None,
    explain: bool = typer.Option(False, "--explain", help="What the peak is made of: its bytes by category and "
                                 "its activations by module and operator (the largest groups, with their share)."),
    no_suggestions: bool = typer.Option(False, "--no-suggestions", help="Skip the 'to fit' suggestions (made when "
                                        "a GPU is given and the job does not fit or has under 10% headroom)."),
    as_json: O.Json = False,
    **options: Any,
) -> None:
    """Per-GPU peak bytes of a training job, by category and phase, with overheads and the fit verdict.

    Exit code 1 when a GPU size is given and the job does not fit.

    Example: memplan estimate llama-3-8b --gpus 8 --stage 2 --gpu h100-80g --explain
    """
    from memplan import cli_estimate
    from memplan.explain import summary
    from memplan.request import from_command

    O.progress_for(as_json)
    if plot:
        from memplan import plot as P

        P.check_path(plot)  # before any work: a bad path is one line, nothing computed or written
    est = cli_estimate.run(from_command({"model": model, **options}, O.explicit(ctx)), with_explain=explain,
                           suggestions=not no_suggestions)
    if plot:
        from memplan import plot as P

        P.draw_estimate(plot, est)
    if as_json:
        R.emit_json(est.report)
    else:
        R.render_plan(est.report, summary(est.explained), est.explained if explain else None)
    if est.plan.fits is False or est.plan.host_fits is False:
        raise typer.Exit(1)


@app.command()
@O.request_options(*O.ALL_PARTS)
def check(
    ctx: typer.Context,
    model: O.Model,
    max_fraction: float = typer.Option(1.0, "--max-fraction", help="Pass only if the required bytes are at most "
                                       "this fraction of the GPU (0.9 keeps 10% free)."),
    as_json: O.Json = False,
    **options: Any,
) -> None:
    """A CI gate: one line, exit 0 when the job fits the GPU (within --max-fraction), 1 when it does not.

    Example: memplan check llama-3-8b --training-args train.json --accelerate-config accelerate.yaml --gpu
    h100-80g --max-fraction 0.9
    """
    import math

    from memplan import cli_estimate
    from memplan.estimate_check import verdict
    from memplan.request import from_command

    if not (math.isfinite(max_fraction) and 0 < max_fraction <= 1):
        raise MemplanError(f"--max-fraction must be in (0, 1], got {max_fraction}")
    if options.get("gpu") is None and options.get("gpu_memory") is None:
        raise MemplanError("check needs the GPU: --gpu NAME (memplan presets) or --gpu-memory SIZE (80GB, 80GiB)")
    O.progress_for(as_json)
    est = cli_estimate.run(from_command({"model": model, **options}, O.explicit(ctx)),
                           progress_text="looking for changes that would fit", max_fraction=max_fraction)
    out = verdict(est, max_fraction)
    if as_json:
        R.emit_json({"schema_version": 1, "check": out, "estimate": est.report})
    else:
        sys.stdout.write(out["line"] + "\n")
    if not out["pass"]:
        raise typer.Exit(1)


#: the job's options `memplan plan` takes (the rest it searches over)
PLAN_FIELDS = ("task", "builder", "activations", "gpu", "gpu_memory", "device", "cpu_isa", "seq_len", "grad_accum",
               "precision", "optimizer", "attention", "allocator_conf", "host_memory")


@app.command()
@O.request_options("adapters")
@O.request_options("model", "cluster", "batch", "training", "memory", only=PLAN_FIELDS)
def plan(
    model: O.Model,
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs per node."),
    max_gpus: int = typer.Option(1024, "--max-gpus", help="Largest GPU count to consider."),
    strategies: str = typer.Option(",".join(("single", "ddp", "zero1", "zero2", "zero3", "zero-optimizer", "fsdp-full",
                                             "fsdp-grad-op", "hsdp")), "--strategies",
                                   help="Comma-separated strategies to consider."),
    recompute: str = typer.Option("none,full", "--recompute", help="Comma-separated: none, selective, full, every:N, "
                                                                 "layer-sac:N."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Fix the micro-batch (else the largest "
                                              "that fits, up to --max-micro-batch)."),
    max_micro_batch: int = typer.Option(64, "--max-micro-batch", help="Largest micro-batch to consider."),
    allow_offload: bool = typer.Option(False, "--allow-offload", help="Also consider DeepSpeed ZeRO-Offload "
                                       "(optimizer, or optimizer and parameters, on the host)."),
    layouts: bool = typer.Option(False, "--layouts", help="Also consider tensor parallelism within a node and "
                                 "pipeline stages across nodes (fsdp-full, ddp, zero1)."),
    plot: O.Plot = None,
    min_headroom: Optional[str] = typer.Option(None, "--min-headroom", help="What every candidate must leave free: "
                                               "a size (8GiB, 8GB) or a fraction of the GPU (0.1 or 10%) "
                                               "[default: 0]."),
    as_json: O.Json = False,
    **options: Any,
) -> None:
    """The fewest GPUs, the largest micro-batch and the best strategy for a model on a GPU size.

    Exit code 1 when nothing fits within --max-gpus.

    Example: memplan plan llama-70b --gpu h100-80g --min-headroom 10%
    """
    from memplan import accounting, planner, progress
    from memplan.model import sources
    from memplan.report import search_report
    from memplan.request import from_command

    O.progress_for(as_json)
    if plot:
        from memplan import plot as P

        P.check_path(plot)  # before any work: a bad path is one line, nothing computed or written
    base = from_command({"model": model, "gpus_per_node": gpus_per_node, **options})
    base = replace(base, adapters=base.adapters.with_adapter())
    space = planner.SearchSpace(max_gpus=max_gpus, strategies=O.csv(strategies, "--strategies"),
                                recomputes=O.csv(recompute, "--recompute"), micro_batch=micro_batch,
                                max_micro_batch=max_micro_batch, allow_offload=allow_offload,
                                min_headroom=min_headroom, layouts=layouts)
    src = sources.with_task(sources.resolve(model), base.model.task)
    inv = sources.build_inventory(src, builder=base.model.builder)
    config = sources.trace_config(src, inv)
    if base.adapters.spec is not None:
        from memplan.model import lora

        inv = lora.apply(inv, base.adapters.spec)
    with progress.task(f"searching layouts for {inv.model_name} (strategies x recompute x GPU counts)"):
        found = planner.search(inv, base, space, config=config)
    best = planner.best_settings(found)
    if plot:
        from memplan import plot as P

        P.draw(plot, P.bars_across_candidates(inv, found), found.gpu_memory_bytes,
               f"{inv.model_name}: the candidates at {found.gpus or found.max_gpus} GPUs", "candidate")
    rep = search_report(found, inv, None if best is None else accounting.estimate(inv, best),
                        planner.command_line(model, found, base.flags(set(options) - {"gpus_per_node"})))
    if as_json:
        R.emit_json(rep)
    else:
        R.render_search(rep)
    if best is None:
        raise typer.Exit(1)


@app.command()
@O.request_options("deepspeed", "torch", "parallel", "adapters")
@O.request_options("training", "files", only=("stage", "strategy", "precision", "optimizer_impl", "deepspeed"))
@O.request_options("batch", "cluster", only=("micro_batch", "grad_accum", "cpu_isa"))
def validate(
    model: O.Model,
    gpus: int = typer.Option(2, "--gpus", help="Ranks to run on this host (spawned)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="Ranks per node [default: gpus]."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Sequence length [default: 128; a vision "
                                          "transformer's: its patches and class token]."),
    optimizer: Optional[str] = typer.Option(None, "--optimizer", help="adamw, adam, sgd, adafactor, adam8bit, lion, "
                                            "adamw-schedulefree, muon, adam-mini, apollo-adamw (the optimizers the "
                                            "harness runs; adam8bit needs bitsandbytes, lion lion-pytorch, "
                                            "adamw-schedulefree schedulefree, adam-mini adam-mini, apollo-adamw "
                                            "apollo-torch)."),
    recompute: str = typer.Option("none", "--recompute", help="none | full | every:N | layer-sac:N."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Scale the model down to this many blocks."),
    hidden: Optional[int] = typer.Option(None, "--hidden", help="Scale the hidden size down (head_dim kept)."),
    vocab: Optional[int] = typer.Option(None, "--vocab", help="Scale the vocabulary down."),
    warmup_steps: int = typer.Option(2, "--warmup-steps", help="Steps before measuring (states get allocated)."),
    steps: int = typer.Option(1, "--steps", help="Measured steps."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda (NCCL) or cpu (gloo) [default: cuda if present]."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds before a hung run is stopped."),
    tolerance: float = typer.Option(0.03, "--tolerance", help="Allowed |relative error| on the peak."),
    as_json: O.Json = False,
    **options: Any,
) -> None:
    """Run the job for real (torch.distributed, real DeepSpeed / FSDP2 / FSDP1 / DDP), measure every rank, compare.

    Exit code 3 when the peak error exceeds --tolerance.

    Example: memplan validate llama-7b --layers 2 --hidden 256 --vocab 2048 --gpus 2 --stage 2 --device cpu
    """
    from memplan.request import from_command
    from memplan.validation import default_device, validation_report
    from memplan.validation import validate as run_validate

    err = R.console(stderr=True)
    if seq_len is None:  # 128 tokens, unless the model is a vision transformer (its sequence is its image's)
        from memplan.model import sources, tasks

        config = sources.resolve(model).config or {}
        seq_len = None if "factory" not in config and tasks.task_of(config) == tasks.IMAGE else 128
    request = from_command({**options, "model": model, "gpus": gpus, "seq_len": seq_len, "optimizer": optimizer,
                            "recompute": recompute, "device": device or default_device(),
                            "gpus_per_node": gpus_per_node if gpus_per_node is not None else gpus})
    request = replace(request, adapters=request.adapters.with_adapter())
    v = run_validate(model, request, layers=layers, hidden=hidden, vocab=vocab, warmup_steps=warmup_steps,
                     measured_steps=steps, timeout_s=timeout, tolerance=tolerance,
                     progress=lambda line: err.print(f"[dim]{line}[/dim]"))
    rep = validation_report(v)
    if as_json:
        R.emit_json(rep)
    else:
        R.render_validation(rep)
    if not v.comparison.within_tolerance:
        raise typer.Exit(3)


def _version_callback(value: bool) -> None:
    if value:
        sys.stdout.write(f"memplan {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(version: Optional[bool] = typer.Option(None, "--version", callback=_version_callback, is_eager=True,
                                                 help="Show the version and exit.")) -> None:
    """memplan: how many bytes each GPU holds at its peak, and whether it fits."""


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the typer app with one error boundary (memplan/cli_boundary.py)."""
    from memplan.cli_boundary import run

    run(app, argv)
