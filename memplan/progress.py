"""A status line on stderr for work that takes more than about a second (tracing a model, a long search): what is
running, how far it is, how long it has taken and how long it should still take. Off unless the command line turns
it on (a terminal on stderr, no --json); the library never prints. rich is imported only when a line is shown."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

_enabled = False
_console: Any = None
#: the innermost task's (progress, task id), for step()
_current: list[tuple[Any, Any]] = []


#: loggers whose import-time warnings are not the user's business: torchao (imported by transformers 5 whenever it
#: is installed: quantizers/quantizer_torchao.py) logs one per CUDA extension it cannot load, and torch one per
#: enum torchao registers with its pytree (torch/utils/_pytree.py register_constant)
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_imports() -> None:
    """Keep the import-time warnings of QUIET_LOGGERS off stderr (the CLI and each harness rank call it first)."""
    import logging

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def enable(on: bool, console: Any = None) -> None:
    """Show status lines from now on (``console``: where; default a rich Console on stderr)."""
    global _enabled, _console
    _enabled, _console = on, console


def wanted(as_json: bool) -> bool:
    """The CLI's rule: a terminal on stderr and no --json."""
    return not as_json and sys.stderr.isatty()


@contextlib.contextmanager
def task(description: str, total: int | None = None) -> Iterator[None]:
    """A status line for the work inside the block; step() advances it (``total`` steps: a bar and the time
    left). Nested tasks share the outer line's display."""
    if not _enabled:
        yield
        return
    if _current:  # already showing a line: add this one below it
        prog = _current[-1][0]
        tid = prog.add_task(description, total=total)
        _current.append((prog, tid))
        try:
            yield
        finally:
            _current.pop()
            prog.remove_task(tid)
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = _console or Console(stderr=True)
    from rich.progress import MofNCompleteColumn

    # steps done / total where the work counts them ("?" for a task without a total: never "None")
    cols = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn()]
    prog = Progress(*cols, console=console, transient=True)
    tid = prog.add_task(description, total=total)
    _current.append((prog, tid))
    prog.start()
    try:
        yield
    finally:
        _current.pop()
        prog.stop()


def doing(what: str) -> None:
    """What the innermost task is doing now (shown after its description: the imports a first trace waits for,
    the micro-step it traces)."""
    if _current:
        prog, tid = _current[-1]
        base = prog.tasks[[t.id for t in prog.tasks].index(tid)].fields.get("base")
        if base is None:
            base = prog.tasks[[t.id for t in prog.tasks].index(tid)].description
            prog.update(tid, base=base)
        prog.update(tid, description=f"{base}: {what}")


def step(n: int = 1) -> None:
    """The innermost task has done ``n`` more of its steps."""
    if _current:
        prog, tid = _current[-1]
        prog.advance(tid, n)
