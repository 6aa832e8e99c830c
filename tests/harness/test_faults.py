"""Harness faults on CPU: a rank killed, a rank stopped, SIGTERM and SIGINT to `memplan validate`, a timeout. Each
ends with a clear outcome well within the timeout, and no process of the run remains."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[2]
#: a small run kept busy long enough to be interrupted (many measured steps of a one-block model)
ARGS = ["validate", "gpt2", "--layers", "1", "--hidden", "64", "--vocab", "128", "--gpus", "2", "--device", "cpu",
        "--strategy", "ddp", "--seq-len", "32", "--warmup-steps", "2", "--steps", "3000"]

pytestmark = pytest.mark.slow


def _start(*extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "memplan", *ARGS, *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _ranks(parent: subprocess.Popen, world: int = 2, wait_s: float = 120.0) -> list:
    """The rank processes once they are all running their steps."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        kids = [p for p in psutil.Process(parent.pid).children(recursive=True)
                if "multiprocessing" in " ".join(p.cmdline()) and "spawn_main" in " ".join(p.cmdline())]
        if len(kids) >= world and all(p.cpu_times().user > 2 for p in kids):  # past imports, into the steps
            return kids
        time.sleep(0.5)
    raise AssertionError("the ranks never started")


def _gone(procs: list, wait_s: float = 15.0) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    return not alive


def _finish(parent: subprocess.Popen, wait_s: float = 60.0) -> tuple[int, str]:
    _, err = parent.communicate(timeout=wait_s)
    return parent.returncode, err


def test_sigterm_to_validate_stops_every_rank():
    parent = _start()
    ranks = _ranks(parent)
    t0 = time.monotonic()
    parent.send_signal(signal.SIGTERM)
    code, err = _finish(parent)
    assert code == 143 and "stopped by SIGTERM; every rank stopped" in err
    assert _gone(ranks) and time.monotonic() - t0 < 30


def test_sigint_to_validate_stops_every_rank():
    parent = _start()
    ranks = _ranks(parent)
    parent.send_signal(signal.SIGINT)
    code, err = _finish(parent)
    assert code == 130 and "Interrupted" in err
    assert _gone(ranks)


def test_sigkill_to_validate_takes_the_ranks_with_it():
    # nothing runs in a killed parent: the ranks die with it (PR_SET_PDEATHSIG)
    parent = _start()
    ranks = _ranks(parent)
    parent.kill()
    parent.wait(timeout=30)
    assert _gone(ranks)


def test_a_killed_rank_is_named_and_the_others_stopped():
    parent = _start()
    ranks = _ranks(parent)
    ranks[1].kill()
    code, err = _finish(parent)
    assert code == 2 and "failed" in err and "killed or crashed" in err
    assert _gone(ranks)


def test_a_stopped_rank_times_out_and_every_rank_is_stopped():
    parent = _start("--timeout", "60")
    ranks = _ranks(parent)
    ranks[0].suspend()  # SIGSTOP: the rank hangs; the other waits in its collective
    t0 = time.monotonic()
    code, err = _finish(parent, wait_s=120)
    assert code == 2 and "still running after --timeout 60 s" in err and "all ranks stopped" in err
    assert _gone(ranks) and time.monotonic() - t0 < 90
