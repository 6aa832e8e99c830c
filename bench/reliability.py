"""Bad and hostile input over every command, model source and surface, each run as a user runs it (a fresh
`python -m memplan` process, an empty profile cache, an empty working directory), timed, and written to
docs/reliability.md: tests/cli/test_bad_inputs.py's table and tests/cli/hostile.py's (the quick suite runs both).

    python bench/reliability.py            # writes docs/reliability.md
    python bench/reliability.py --print

A refused input is clean when it exits 2 with one line on stderr naming the problem (the table's needle), nothing
on stdout and nothing written, within LIMIT_S seconds (a factory's own import and a trace are exempt: the
factory's time limit, MEMPLAN_FACTORY_TIMEOUT, and the trace take what they take). An input that runs is clean
when it gives the exit code its verdict decides, with no traceback.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "cli"))
sys.path.insert(0, str(ROOT / "tests"))  # tests/clirun.py, which test_bad_inputs imports

import hostile  # noqa: E402
import test_bad_inputs as bad  # noqa: E402

LIMIT_S = 2.0


def _cases() -> list[hostile.Case]:
    """Both tables as hostile.Case rows (test_bad_inputs' are refusals of its own files, in {dir}/bad)."""
    old = [hostile.Case(args.replace("{dir}", "{dir}/bad"), needle, "bad input (" + args.split()[0] + ")")
           for args, needle in bad.CASES]
    return old + list(hostile.CASES)


def _run(case: hostile.Case, d: Path, tmp: Path) -> tuple[int, str, str, bool, float]:
    work, cache = tmp / "work", tmp / "cache"
    work.mkdir()
    own = hostile.env_for(case, d)
    env = {k: v for k, v in {**os.environ, "MEMPLAN_CACHE_DIR": str(cache), **own}.items() if v is not None}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (own.get("PYTHONPATH"), str(ROOT)) if p)
    start = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "memplan", *hostile.argv(case, d)], capture_output=True, cwd=work,
                           env=env, timeout=300)
        code, out, err = r.returncode, r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")
    except subprocess.TimeoutExpired:
        code, out, err = -9, "", "(still running after 300 s: stopped)"
    took = time.monotonic() - start
    wrote = (cache.exists() and any(cache.rglob("*"))) or any(work.iterdir())
    return code, out, err, wrote, took


def _clean(case: hostile.Case, code: int, out: str, err: str, wrote: bool, took: float) -> tuple[bool, str]:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if "Traceback" in err:
        return False, "traceback"
    if code != case.expect:
        return False, f"exit {code}, not {case.expect}"
    if case.expect != 2:
        return True, ""
    if len(lines) != 1 or not lines[0].startswith("Error: ") or case.needle not in lines[0]:
        return False, "not one line naming the problem"
    if out:
        return False, "wrote to stdout"
    if wrote:
        return False, "wrote a file"
    exempt = case.surface == "factory" and ("import" in case.needle or "did not finish" in case.needle)
    if took > LIMIT_S and not exempt:
        return False, f"took {took:.1f} s"
    return True, ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--print", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "files"
        hostile.make_files(d)
        b = d / "bad"
        for rel, content in bad.FILES.values():
            p = b / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content if isinstance(content, bytes) else content.encode())
        os.mkfifo(b / "fifo.json")
        for i, case in enumerate(_cases()):
            run_dir = Path(tmp) / f"run{i}"
            run_dir.mkdir()
            code, out, err, wrote, took = _run(case, d, run_dir)
            ok, why = _clean(case, code, out, err, wrote, took)
            lines = [ln for ln in err.splitlines() if ln.strip()]
            shown = (lines[0] if lines else "").replace(str(d), "{dir}")
            if case.expect != 2:
                shown = f"(exit {code}: the job runs, its verdict decides)" if not lines or "Error" not in shown \
                    else shown
            rows.append((case, code, len(lines), wrote, took, ok, why, shown))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "unknown"
    total, clean = len(rows), sum(1 for r in rows if r[5])
    by_surface: dict[str, list[int]] = {}
    for case, *_, ok, _why, _shown in rows:
        s = by_surface.setdefault(case.surface, [0, 0])
        s[0] += 1
        s[1] += ok
    slowest = max(rows, key=lambda r: r[4])
    refused = [r for r in rows if r[0].expect == 2]
    slow_refusal = max((r for r in refused if not (r[0].surface == "factory")), key=lambda r: r[4])
    text = ["# Reliability: bad and hostile input", "",
            f"Made by `python bench/reliability.py` at commit {commit}: the {len(bad.CASES)} bad inputs of "
            f"tests/cli/test_bad_inputs.py and the {len(hostile.CASES)} hostile ones of tests/cli/hostile.py (the "
            "quick suite runs both tables; the factory cases that wait for a time limit run in the slow suite), each "
            "run as a user runs it: a fresh `python -m memplan` process with an empty profile cache and an empty "
            "working directory, on this 2-core machine. `{dir}` is the directory of the files the cases name "
            "(job files, model directories, FIFOs, links to /dev/zero, a Hugging Face cache, factory modules).", "",
            f"**{clean} of {total} clean.** A refused input is clean when it exits 2 with one line on stderr naming "
            f"the problem, nothing on stdout and nothing written, within {LIMIT_S:g} s (a factory's import and "
            "call wait for MEMPLAN_FACTORY_TIMEOUT, 2 s here, and a factory that ignores SIGALRM for it plus "
            "10 s); an input that runs is clean when it gives the exit code its verdict decides (a "
            "per_process_memory_fraction of 5% makes a job that fits on the card exit 1), with no traceback.", "",
            f"Slowest case: `{slowest[0].args[:100]}` ({slowest[0].surface}), {slowest[4]:.1f} s; the slowest "
            f"refusal outside the factories: `{slow_refusal[0].args[:100]}`, {slow_refusal[4]:.2f} s.", "",
            "| surface | cases | clean |", "|---|---:|---:|"]
    for surface, (n, ok) in sorted(by_surface.items()):
        text.append(f"| {surface} | {n} | {ok} |")
    text += ["", "| surface | command | environment | exit | stderr lines | wrote | s | clean | message |",
             "|---|---|---|---:|---:|---|---:|---|---|"]
    for case, code, n, wrote, took, ok, why, shown in rows:
        env = ", ".join(f"{k}={v}" if v is not None else f"{k} unset" for k, v in case.env.items())[:80]
        cmd = (case.args[:110] + ("..." if len(case.args) > 110 else "")) if case.args else "(no arguments)"
        msg = shown.replace("|", "\\|")[:300]
        text.append(f"| {case.surface} | `{cmd}` | {env.replace('|', ' ')} | {code} | {n} | "
                    f"{'yes' if wrote else 'no'} | {took:.2f} | {'yes' if ok else 'NO: ' + why} | {msg} |")
    text += ["", "Not in the table, because they need processes or signals:", "",
             "- `memplan validate` faults (tests/harness/test_faults.py, slow suite): SIGTERM to the parent exits 143 "
             "(\"stopped by SIGTERM; every rank stopped\"), SIGINT exits 130 (\"Interrupted.\"), SIGKILL to the "
             "parent takes the ranks with it (PR_SET_PDEATHSIG), a killed rank is named (exit 2) and the others "
             "stopped, a stopped (SIGSTOP) rank ends the run at --timeout with every rank stopped; in each case no "
             "process of the run remains;",
             "- a factory that starts a process of its own leaves none behind (the child's whole process group is "
             "killed: tests/cli/test_hostile_inputs.py test_a_factory_leaves_no_process_behind)."]
    out = "\n".join(text) + "\n"
    if args.print:
        print(out)
    else:
        (ROOT / "docs" / "reliability.md").write_text(out)
        print(f"{clean}/{total} clean -> docs/reliability.md (slowest {slowest[4]:.1f} s: {slowest[0].args[:60]})")
    for case, code, n, wrote, took, ok, why, shown in rows:
        if not ok:
            print(f"NOT CLEAN: {case.args[:80]} [{case.surface}] {why}: {shown[:200]}", file=sys.stderr)


if __name__ == "__main__":
    main()
