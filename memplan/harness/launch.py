"""Launch a validation run: N ranks on this host (spawned), watched, stopped together; results collected.

A rank that fails or hangs past the timeout ends the run: every rank is killed, the failing rank and its error
are reported, and no process is left behind. The rendezvous port is chosen free. Progress lines (rank, state)
go to a callback the CLI prints on stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from memplan.errors import MemplanError


class HarnessError(MemplanError):
    """A rank crashed or timed out (exit code 2: the run could not be measured)."""


class Terminated(MemplanError):
    """The run was stopped by SIGTERM (a CI system cancelling the job): every rank stopped, exit 128 + 15."""

    exit_code = 143


@contextlib.contextmanager
def _sigterm_stops_the_run() -> Iterator[None]:
    """SIGTERM's default action ends the process at once, leaving the ranks running; raise instead, so the run's
    cleanup stops them (the main thread only: signal handlers live there)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(_signum: int, _frame: Any) -> None:
        raise Terminated("stopped by SIGTERM; every rank stopped")

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@dataclass(frozen=True)
class RunResult:
    ranks: tuple[dict[str, Any], ...]  #: rank<R>.json contents, by rank
    wall_s: float


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


def launch(spec: dict[str, Any], world: int, *, timeout_s: float = 600.0,
           progress: Callable[[str], None] | None = None) -> RunResult:
    """Run ``world`` ranks of ``spec`` with torch.multiprocessing's spawn context and wait for all of them."""
    import multiprocessing as mp

    from memplan.harness import run as run_mod

    out = tempfile.mkdtemp(prefix="memplan-validate-")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=run_mod._spawn_entry, args=(r, world, port, spec, out), daemon=False)
             for r in range(world)]
    t0 = time.monotonic()
    last_status: dict[int, str] = {}
    with _sigterm_stops_the_run():
        return _watch(procs, out, world, t0, timeout_s, last_status, progress)


def _watch(procs: list[Any], out: str, world: int, t0: float, timeout_s: float, last_status: dict[int, str],
           progress: Callable[[str], None] | None) -> RunResult:
    """Start the ranks, follow their states, stop them all at the first failure, the timeout, or a signal."""
    try:
        for p in procs:
            p.start()
        while True:
            time.sleep(0.2)
            for r in range(world):
                lines = _read(os.path.join(out, f"rank{r}.status")).splitlines()
                if lines:
                    state = lines[-1].split(" ", 1)[1]
                    if last_status.get(r) != state:
                        last_status[r] = state
                        if progress:
                            progress(f"rank {r}: {state}")
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                r = failed[0]
                err = _read(os.path.join(out, f"rank{r}.error"))
                first = err.splitlines()[0] if err else f"exit code {procs[r].exitcode} (killed or crashed)"
                raise HarnessError(f"rank {r} failed: {first}" + (
                    f" [traceback in {os.environ.get('MEMPLAN_KEEP', '')}]" if os.environ.get("MEMPLAN_KEEP") else ""))
            if all(p.exitcode == 0 for p in procs):
                break
            if time.monotonic() - t0 > timeout_s:
                stuck = [r for r, p in enumerate(procs) if p.exitcode is None]
                raise HarnessError(f"rank(s) {', '.join(map(str, stuck))} still running after --timeout {timeout_s:g} s "
                                   f"(last state: {last_status.get(stuck[0], 'not started')}); all ranks stopped")
        ranks = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.json")) as fh:
                ranks.append(json.load(fh))
        return RunResult(ranks=tuple(ranks), wall_s=time.monotonic() - t0)
    finally:
        started = [p for p in procs if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(timeout=10)
        keep = os.environ.get("MEMPLAN_KEEP")
        if keep:
            shutil.copytree(out, keep, dirs_exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)
