"""The command line's one error boundary: user errors (MemplanError) are one line and exit 2, usage errors one line
and exit 2, interrupts 130, a bug in memplan one line and exit 1 (MEMPLAN_DEBUG=1 shows the traceback)."""

from __future__ import annotations

import sys

import typer

from memplan.errors import MemplanError


def _one_line(text: str) -> str:
    """A message on one line: what other libraries put on several (transformers' validation text) is joined."""
    return "; ".join(part.strip() for part in text.strip().splitlines() if part.strip())


def run(app: typer.Typer, argv: list[str] | None = None) -> None:
    """Run the typer app with one error boundary: every error one line, its exit code."""
    try:  # typer >= 0.26 vendors click as typer._click; its exceptions are not click's, and Abort / Exit
        from typer._click import exceptions as click_exc  # moved to typer.exceptions
        from typer.exceptions import Abort, Exit
    except ImportError:  # pragma: no cover - older typer on upstream click
        from click import exceptions as click_exc
        from click.exceptions import Abort, Exit

    command = typer.main.get_command(app)
    try:
        rc = command.main(args=argv, prog_name="memplan", standalone_mode=False)
    except MemplanError as exc:
        sys.stderr.write(f"Error: {_one_line(str(exc))}\n")
        sys.exit(exc.exit_code)
    except click_exc.UsageError as exc:  # one line, as every other input error (click prints usage and a hint)
        where = f"memplan {exc.ctx.info_name}: " if exc.ctx is not None and exc.ctx.parent is not None else ""
        sys.stderr.write(f"Error: {where}{_one_line(exc.format_message())} (--help lists the options)\n")
        sys.exit(2)
    except Abort:
        sys.stderr.write("Aborted.\n")
        sys.exit(1)
    except Exit as exc:
        if exc.exit_code == 130:
            sys.stderr.write("Interrupted.\n")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("Interrupted.\n")
        sys.exit(130)
    except Exception as exc:  # a bug in memplan: one line, not a traceback (MEMPLAN_DEBUG=1 shows it)
        import os

        if os.environ.get("MEMPLAN_DEBUG"):
            raise
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        sys.stderr.write(f"Error: internal error ({type(exc).__name__}: {first}); MEMPLAN_DEBUG=1 shows where\n")
        sys.exit(1)
    if rc == 130:  # typer turns Ctrl-C / SIGINT into Exit(130), returned here: say so (validate stopped its ranks)
        sys.stderr.write("Interrupted.\n")
    sys.exit(rc if isinstance(rc, int) else 0)
