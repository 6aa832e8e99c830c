"""memplan's command line run in the test's own process (what the CLI tests share)."""

from __future__ import annotations

import contextlib
import io


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """memplan's entry point in this process: (exit code, stdout, stderr)."""
    from memplan.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()
