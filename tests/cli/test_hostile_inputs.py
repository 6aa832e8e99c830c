"""Hostile input on every surface (tests/cli/hostile.py's table, issue 41): a refused input is one line on stderr
naming the problem, exit code 2, nothing on stdout and nothing written (profile cache, working directory, the
files named); an input that runs gives the exit code its verdict decides, with no traceback. The table's factory
cases that wait for a time limit run in the slow suite; bench/reliability.py runs them all and times each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hostile import CASES, Case, argv, env_for, make_files
from test_bad_inputs import run_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hostile_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    make_files(d)
    return d


def run_case(case: Case, d: Path, work: Path, cache: Path, monkeypatch=None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of one case: in this process, or in a fresh interpreter where the case reads
    its environment at start (an encoding, shell completion) or starts processes of its own."""
    env = env_for(case, d)
    if case.subprocess or monkeypatch is None:
        full = {k: v for k, v in {**os.environ, "MEMPLAN_CACHE_DIR": str(cache), **env}.items() if v is not None}
        full["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
        r = subprocess.run([sys.executable, "-m", "memplan", *argv(case, d)], capture_output=True, cwd=work,
                           env=full, timeout=120)
        return r.returncode, r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(cache))
    for k, v in env.items():
        if k == "PYTHONPATH":
            monkeypatch.syspath_prepend(v)
        elif v is not None:
            monkeypatch.setenv(k, v)
        else:
            monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(work)
    return run_cli(argv(case, d))


def check(case: Case, code: int, out: str, err: str, wrote: bool) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert code == case.expect, (code, out[-500:], err[-500:])
    if case.expect == 2:
        assert len(lines) == 1 and lines[0].startswith("Error: "), err[-2000:]
        assert case.needle in lines[0], lines[0]
        assert len(lines[0]) < 1200, len(lines[0])
        assert out == ""
        assert not wrote


def _written(cache: Path, work: Path) -> bool:
    return (cache.exists() and any(cache.rglob("*"))) or any(work.iterdir())


QUICK = [c for c in CASES if not c.slow]


def test_the_table_covers_every_surface():
    surfaces = {c.surface.split()[0] for c in CASES}
    assert {"training-args", "accelerate-config", "adapter-config", "check", "allocator-conf", "plot", "completion",
            "factory", "fsdp-wrap", "z3-leaf", "lora", "parallel", "hf-cache", "config.json", "encoding"} <= surfaces
    assert len(CASES) >= 280


@pytest.mark.parametrize("case", QUICK, ids=[f"{c.surface}:{c.args[:50]}" for c in QUICK])
def test_hostile_input(case, hostile_dir, tmp_path, monkeypatch):
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    code, out, err = run_case(case, hostile_dir, work, cache, monkeypatch)
    check(case, code, out, err, case.expect == 2 and _written(cache, work))


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.slow], ids=lambda c: c.args[:50])
def test_hostile_input_that_waits_for_a_limit(case, hostile_dir, tmp_path, monkeypatch):
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    code, out, err = run_case(case, hostile_dir, work, cache, monkeypatch)
    check(case, code, out, err, _written(cache, work))


def test_a_factory_leaves_no_process_behind(hostile_dir, tmp_path, monkeypatch):
    # the factory starts `sleep 300.0421` and fails: its whole process group is stopped with it (a duration no other
    # process on the machine runs, so pgrep finds the factory's child only)
    case = next(c for c in CASES if "spawns" in c.args)
    work = tmp_path / "work"
    work.mkdir()
    run_case(case, hostile_dir, work, tmp_path / "cache", monkeypatch)
    left = subprocess.run(["pgrep", "-f", "sleep 300.0421"], capture_output=True, text=True).stdout.split()
    assert not left, left
