"""Speed side by side: the same memplan command in two source trees (a commit's worktree and this one), whole
process, runs alternated so that both see the same machine. Writes nothing; prints the min and median of each.

    git worktree add /tmp/base COMMIT
    python bench/speed_ab.py /tmp/base . 9 estimate llama-7b --gpus 8 --stage 3

Each tree runs as ``python -m memplan ARGS`` with its own directory first on PYTHONPATH, bytecode written
(PYTHONDONTWRITEBYTECODE unset, as an install has it), after one untimed run each.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    trees = [str(Path(sys.argv[1]).resolve()), str(Path(sys.argv[2]).resolve())]
    repeat, args = int(sys.argv[3]), sys.argv[4:]
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)

    def run(tree: str) -> float:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "memplan", *args], cwd=tree, env=dict(env, PYTHONPATH=tree),
                       capture_output=True, check=False)
        return time.perf_counter() - t

    for tree in trees:
        run(tree)
    times: dict[str, list[float]] = {tree: [] for tree in trees}
    for _ in range(repeat):
        for tree in trees:
            times[tree].append(run(tree))
    print(f"memplan {' '.join(args)} ({repeat} runs each, alternated)")
    for tree in trees:
        v = sorted(times[tree])
        print(f"  {tree}: min {v[0]:.3f} s, median {v[len(v) // 2]:.3f} s")


if __name__ == "__main__":
    main()
