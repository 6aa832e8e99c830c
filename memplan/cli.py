"""Command line: thin typer commands (parse, call, render). The only module that imports typer and rich.

User errors (MemplanError) become ``Error: <message>`` on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional

import typer

from memplan import __version__
from memplan.errors import MemplanError
from memplan.units import fmt_bytes

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Per-GPU memory of distributed training jobs, before you launch them. "
                       "Sizes are shown in binary units (GiB = 2^30 bytes).")


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def _table(title: str, columns: list[tuple[str, str]], rows: list[list[str]]):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for header, justify in columns:
        t.add_column(header, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        t.add_row(*r)
    return t


@app.command()
def presets(as_json: bool = typer.Option(False, "--json", help="Print JSON on stdout.")) -> None:
    """List the shipped model presets and GPU presets."""
    from memplan.model import sources

    models = []
    for name in sources.preset_names():
        src = sources.resolve(name)
        inv = sources.build_inventory(src)
        aliases = sorted(a for a, c in sources.PRESET_ALIASES.items() if c == name)
        models.append({"name": name, "aliases": aliases, "model_type": src.config.get("model_type"),
                       "num_params": inv.num_params, "name_or_path": src.config.get("_name_or_path")})
    gpus = [{"id": k, **v} for k, v in sources.gpu_presets().items()]
    if as_json:
        _emit_json({"schema_version": 1, "models": models, "gpus": gpus})
        return
    c = _console()
    c.print(_table("Model presets (real config.json files)", [("preset", "left"), ("aliases", "left"),
                                                             ("model_type", "left"), ("parameters", "right")],
                   [[m["name"], ", ".join(m["aliases"]), m["model_type"], f"{m['num_params']:,}"] for m in models]))
    c.print(_table("GPU presets (usable = memory the driver reports)", [("gpu", "left"), ("device", "left"),
                                                                       ("usable", "right"), ("bytes", "right")],
                   [[g["id"], f"{g['name']} ({g['nominal']})", fmt_bytes(g["usable_bytes"]), f"{g['usable_bytes']:,}"]
                    for g in gpus]))


@app.command()
def inspect(
    model: str = typer.Argument(..., help="Preset name, config.json, model directory, cached repo id, or pkg.mod:fn."),
    builder: str = typer.Option("auto", help="auto | analytic (from config, no torch) | meta (instantiate on meta)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON on stdout."),
) -> None:
    """Parameters of a model: counts, bytes per dtype, categories, blocks, largest block and tensor, ties."""
    from memplan.model import sources
    from memplan.report import inspect_report

    inv = sources.build_inventory(sources.resolve(model), builder=builder)
    rep = inspect_report(inv)
    if as_json:
        _emit_json(rep)
        return
    c = _console()
    m = rep["model"]
    c.print(f"[bold]{m['name']}[/bold]  {m['num_params']:,} parameters  ({m['family']}, {m['source']}, "
            f"builder: {m['builder']})")
    c.print(_table("Stored bytes by dtype", [("dtype", "left"), ("bytes", "right"), ("size", "right")],
                   [[d, f"{b:,}", fmt_bytes(b)] for d, b in rep["bytes_by_dtype"].items()]))
    total = m["num_params"]
    c.print(_table("Parameters by category", [("category", "left"), ("parameters", "right"), ("share", "right")],
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


def _version_callback(value: bool) -> None:
    if value:
        sys.stdout.write(f"memplan {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(version: Optional[bool] = typer.Option(None, "--version", callback=_version_callback, is_eager=True,
                                                 help="Show the version and exit.")) -> None:
    """memplan: how many bytes each GPU holds at its peak, and whether it fits."""


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the typer app with one error boundary."""
    import click

    command = typer.main.get_command(app)
    try:
        rc = command.main(args=argv, prog_name="memplan", standalone_mode=False)
    except MemplanError as exc:
        sys.stderr.write(f"Error: {exc}\n")
        sys.exit(exc.exit_code)
    except click.exceptions.UsageError as exc:
        exc.show()
        sys.exit(2)
    except click.exceptions.Abort:
        sys.stderr.write("Aborted.\n")
        sys.exit(1)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("Interrupted.\n")
        sys.exit(130)
    sys.exit(rc if isinstance(rc, int) else 0)
