"""The command line's one error boundary: user errors (MemplanError) are one line and exit 2, usage errors one line
and exit 2, interrupts 130, a bug in memplan one line and exit 1 (MEMPLAN_DEBUG=1 shows the traceback)."""

from __future__ import annotations

import os
import sys

import typer

from memplan.errors import MemplanError


#: the longest run of characters without a space an error line shows whole (a path); a longer one (a value
#: pasted on the command line: click quotes it whole) is cut in its middle
LONGEST_WORD = 160
#: the longest error line
LONGEST_LINE = 1000


def _one_line(text: str) -> str:
    """A message on one line: what other libraries put on several (transformers' validation text) is joined;
    a value of thousands of characters is cut in its middle, never printed whole."""
    import re

    line = "; ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    line = re.sub(r"\S{%d,}" % (LONGEST_WORD + 1),
                  lambda m: m.group(0)[:LONGEST_WORD // 2] + f"...({len(m.group(0)):,} characters)..."
                  + m.group(0)[-LONGEST_WORD // 4:], line)
    if len(line) > LONGEST_LINE:
        line = line[:LONGEST_LINE - 40] + f"... ({len(line):,} characters)"
    return line


#: what memplan's own output prints outside ASCII, and what it prints instead where the stream cannot encode it
#: (PYTHONIOENCODING=ascii, a C locale): the table and bar characters, arrows, comparison signs
ASCII_FALLBACK = {"·": ".", "≤": "<=", "≥": ">=", "×": "x", "◀": "<", "▶": ">", "→": "->", "←": "<-", "…": "...",
                  "—": "-", "–": "-", "≈": "~", "±": "+/-", "µ": "u", "²": "^2", "✓": "ok", "✗": "x", "│": "|",
                  "─": "-", "┃": "|", "━": "-", "┏": "+", "┓": "+", "┗": "+", "┛": "+", "┡": "+", "┩": "+", "┳": "+",
                  "┻": "+", "╇": "+", "┣": "+", "┫": "+", "╋": "+", "┌": "+", "┐": "+", "└": "+", "┘": "+", "├": "+",
                  "┤": "+", "┬": "+", "┴": "+", "┼": "+", "█": "#", "░": ".", "▏": "|", "•": "*", "‘": "'", "’": "'",
                  "“": '"', "”": '"'}


def _ascii_fallback(exc: UnicodeError) -> tuple[str, int]:
    """A codecs error handler: each character the stream cannot encode becomes its ASCII_FALLBACK, else "?"."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    text = exc.object[exc.start:exc.end]
    return "".join(ASCII_FALLBACK.get(ch, "?") for ch in text), exc.end


def _streams_that_encode() -> None:
    """stdout and stderr print every character memplan writes: where their encoding lacks one (PYTHONIOENCODING=
    ascii, LANG=C), it is written as ASCII (ASCII_FALLBACK), never an encoding error."""
    import codecs

    try:
        codecs.lookup_error("memplan-ascii")
    except LookupError:
        codecs.register_error("memplan-ascii", _ascii_fallback)
    for stream in (sys.stdout, sys.stderr):
        enc = getattr(stream, "encoding", None) or "ascii"
        try:
            "·≤×◀─".encode(enc)
            continue
        except (UnicodeEncodeError, LookupError):
            pass
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="memplan-ascii")
            except (ValueError, OSError):  # a stream already written in another way
                pass


_COMPLETE = "_MEMPLAN_COMPLETE"


def _check_completion() -> None:
    """Shell completion (typer's, asked through _MEMPLAN_COMPLETE): the instruction and the variables the shell
    sets are checked first, so a bad one is one line and exit 2 (typer would int() COMP_CWORD and fail)."""
    import os
    import re

    from memplan.inputs import quote

    inst = os.environ.get(_COMPLETE)
    if inst is None:
        return
    m = re.fullmatch(r"(source|complete)_(bash|zsh|fish|powershell|pwsh)", inst)
    if not m:
        raise MemplanError(f"shell completion: {_COMPLETE}={quote(inst)} is not source_SHELL or complete_SHELL "
                           "(SHELL: bash, zsh, fish, powershell, pwsh)")
    if m.group(1) == "complete" and m.group(2) == "bash":
        words, cword = os.environ.get("COMP_WORDS"), os.environ.get("COMP_CWORD")
        if words is None or cword is None:
            raise MemplanError("shell completion: bash sets COMP_WORDS and COMP_CWORD; one is missing")
        if not re.fullmatch(r"[0-9]{1,6}", cword.strip()):
            raise MemplanError(f"shell completion: COMP_CWORD={quote(cword)} is not a word index")


def _invoked(app: typer.Typer, args: list[str]) -> typer.Typer:
    """The app with only the command ``args`` name, where they name one and no completion is asked: typer builds
    every registered command's parameters before it parses (about 50 ms of a 0.3 s estimate), and the others are
    never read. ``memplan --help``, ``--version`` and shell completion get the whole app."""
    import copy

    import typer.main

    if not args or os.environ.get(_COMPLETE):
        return app
    named = [c for c in app.registered_commands
             if (c.name or typer.main.get_command_name(c.callback.__name__)) == args[0]]
    if len(named) != 1:
        return app
    one = copy.copy(app)
    one.registered_commands = named
    return one


def run(app: typer.Typer, argv: list[str] | None = None) -> None:
    """Run the typer app with one error boundary: every error one line, its exit code."""
    _streams_that_encode()
    from memplan import progress

    progress.quiet_imports()
    try:  # typer >= 0.26 vendors click as typer._click; its exceptions are not click's, and Abort / Exit
        from typer._click import exceptions as click_exc  # moved to typer.exceptions
        from typer.exceptions import Abort, Exit
    except ImportError:  # pragma: no cover - older typer on upstream click
        from click import exceptions as click_exc
        from click.exceptions import Abort, Exit

    command = typer.main.get_command(_invoked(app, sys.argv[1:] if argv is None else argv))
    try:
        _check_completion()
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
