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
from memplan.request import HarnessRun, SearchSpace

app = typer.Typer(add_completion=True, no_args_is_help=True, rich_markup_mode=None,
                  help="Per-GPU memory of distributed training jobs, before you launch them. "
                       "Sizes are shown in binary units (GiB = 2^30 bytes).")


@app.command()
def presets(as_json: bool = typer.Option(False, "--json", help="Print JSON on stdout.")) -> None:
    """List the shipped model presets and GPU presets.

    Example: memplan presets --json
    """
    from memplan.report import presets_report

    rep = presets_report()
    R.emit_json(rep) if as_json else R.render_presets(rep)


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
    R.emit_json(rep) if as_json else R.render_inspect(rep)


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
    """A CI gate: one line, exit 0 when the job fits the GPU (within --max-fraction), 1 when it does not or when
    that is unknown (UNKNOWN: the caching allocator is not replayed for this job and its bound is within).

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
PLAN_FIELDS = ("task", "builder", "activations", "freeze", "gpu", "gpu_memory", "device", "cpu_isa", "seq_len", "target_len",
               "images", "image_size",
               "grad_accum",
               "precision", "optimizer", "attention", "compile", "float8", "float8_keep", "float8_all_gather", "allocator_conf",
               "host_memory", "fragmentation_percent")


@app.command()
@O.request_options("adapters")
@O.request_options("model", "cluster", "batch", "training", "memory", only=PLAN_FIELDS)
@O.request_options(SearchSpace)
def plan(
    model: O.Model,
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs per node."),
    plot: O.Plot = None,
    as_json: O.Json = False,
    **options: Any,
) -> None:
    """The fewest GPUs, the largest micro-batch and the best strategy for a model on a GPU size.

    Exit code 1 when nothing fits within --max-gpus.

    Example: memplan plan llama-70b --gpu h100-80g --min-headroom 10%
    """
    from memplan import cli_estimate
    from memplan.request import build, from_command

    O.progress_for(as_json)
    if plot:
        from memplan import plot as P

        P.check_path(plot)  # before any work: a bad path is one line, nothing computed or written
    space = build(SearchSpace, options)
    asked = {k: v for k, v in options.items() if k not in vars(space)}  # the job's options; the rest: the search's
    base = from_command({"model": model, "gpus_per_node": gpus_per_node, **asked})
    rep, best = cli_estimate.plan(base, space, plot, base.flags(asked))
    if as_json:
        R.emit_json(rep)
    else:
        R.render_search(rep)
    if best is None:
        raise typer.Exit(1)


@app.command()
@O.request_options("deepspeed", "torch", "parallel", "adapters")
@O.request_options("training", "files", only=("stage", "strategy", "precision", "optimizer_impl", "compile",
                                               "float8", "float8_keep", "float8_all_gather",
                                               "deepspeed"))
@O.request_options("batch", "cluster", only=("micro_batch", "target_len", "images", "image_size", "grad_accum", "cpu_isa"))
@O.request_options("model", only=("task", "freeze"))
@O.request_options(HarnessRun)
def validate(
    model: O.Model,
    gpus: int = typer.Option(2, "--gpus", help="Ranks to run on this host (spawned)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="Ranks per node [default: gpus]."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Sequence length [default: 128; a vision "
                                          "transformer's: its patches and class token]."),
    optimizer: Optional[str] = typer.Option(None, "--optimizer", help="adamw, adam, sgd, adafactor, adam8bit, lion, "
                                            "adamw-schedulefree, muon, muon-with-aux-adam, adam-mini, apollo-adamw, "
                                            "galore-adamw (the optimizers the harness runs; adam8bit needs "
                                            "bitsandbytes, lion lion-pytorch, adamw-schedulefree schedulefree, "
                                            "muon-with-aux-adam muon-optimizer, adam-mini adam-mini, apollo-adamw "
                                            "apollo-torch, galore-adamw galore-torch)."),
    recompute: str = typer.Option("none", "--recompute", help="none | full | every:N | layer-sac:N."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda (NCCL) or cpu (gloo) [default: cuda if present]."),
    as_json: O.Json = False,
    **options: Any,
) -> None:
    """Run the job for real (torch.distributed, real DeepSpeed / FSDP2 / FSDP1 / DDP), measure every rank, compare.

    Exit code 3 when the peak error exceeds --tolerance.

    Example: memplan validate llama-7b --layers 2 --hidden 256 --vocab 2048 --gpus 2 --stage 2 --device cpu
    """
    from memplan.request import build, from_command
    from memplan.validation import default_device, validation_report
    from memplan.validation import validate as run_validate

    err = R.console(stderr=True)
    if seq_len is None:  # 128 tokens, unless the model is a vision transformer (its sequence is its image's)
        from memplan.model import sources, tasks

        config = sources.with_task(sources.resolve(model), options.get("task")).config or {}
        seq_len = None if "factory" not in config and tasks.task_of(config) == tasks.IMAGE else 128
    run = build(HarnessRun, options)
    request = from_command({**options, "model": model, "gpus": gpus, "seq_len": seq_len, "optimizer": optimizer,
                            "recompute": recompute, "device": device or default_device(),
                            "gpus_per_node": gpus_per_node if gpus_per_node is not None else gpus})
    request = replace(request, adapters=request.adapters.with_adapter())
    v = run_validate(model, request, layers=run.layers, hidden=run.hidden, vocab=run.vocab,
                     warmup_steps=run.warmup_steps, measured_steps=run.steps, timeout_s=run.timeout,
                     tolerance=run.tolerance, progress=lambda line: err.print(f"[dim]{line}[/dim]"))
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
