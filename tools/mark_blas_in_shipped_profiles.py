"""Add the traced step's first cuBLAS calls (alloc_events "blas": LiveBytes.blas) to the shipped activation
profiles, which were traced before the tracer marked them, without changing anything else in them.

Run: python tools/mark_blas_in_shipped_profiles.py [PRESET ...]

Each shipped profile is traced again (the same jobs as tools/ship_activation_profiles.py); the marks are written
into the stored file only where the new trace's allocation events equal the stored ones, so that no other figure
moves. A profile whose events differ is left as it is and listed (memplan/replay.py then guesses the marks)."""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from ship_activation_profiles import DEFAULT_SEQ, RECIPES, RECOMPUTE, linears, targets  # noqa: E402

from memplan.activations import profile_cache  # noqa: E402
from memplan.errors import MemplanError  # noqa: E402
from memplan.model import sources  # noqa: E402
from memplan.activations.profile_fit import fit_seqs  # noqa: E402
from memplan.activations.tracing import trace_profile  # noqa: E402
from memplan.activations.tracing_keys import trace_recipe  # noqa: E402


def main() -> int:
    out = profile_cache.shipped_dir()
    names = sys.argv[1:] or sources.preset_names()  # given: in that order (to run several processes)
    done = same = differ = 0
    for name in names:
        config = sources.resolve(name).config
        seqs = [DEFAULT_SEQ] + sorted(set(fit_seqs(config)) - {DEFAULT_SEQ})
        for seq in seqs:
            for recipe in RECIPES:
                for rc in RECOMPUTE:
                    for lin in linears(recipe):
                        for tg in targets():
                            k = profile_cache.profile_key(config, seq_len=seq, recipe=recipe, attention="flash",
                                                          recompute=rc, linear=lin, target=tg)
                            path = out / f"{k}.json.gz"
                            if not path.exists():
                                continue
                            stored = json.loads(gzip.open(path, "rt").read())
                            ae = stored.get("alloc_events")
                            if not ae or "blas" in ae:
                                same += 1
                                continue
                            t = time.perf_counter()
                            try:
                                fresh = trace_profile(config, seq_len=seq, recipe=trace_recipe(recipe),
                                                      attention="flash", recompute=rc, linear=lin, target=tg)
                            except MemplanError as exc:
                                print(f"{name} {seq} {recipe} {rc} {lin} {tg.key}: not traced: {exc}", flush=True)
                                continue
                            new = dict(fresh.get("alloc_events") or {})
                            blas = new.pop("blas", None)
                            if blas is None or json.loads(json.dumps(new)) != ae:
                                differ += 1
                                print(f"{name} {seq} {recipe} {rc} {lin} {tg.key}: events differ, left as stored",
                                      flush=True)
                                continue
                            ae["blas"] = blas
                            with gzip.open(path, "wt", compresslevel=9) as f:
                                f.write(json.dumps(stored, separators=(",", ":")))
                            done += 1
                            print(f"{name} {seq} {recipe} {rc} {lin} {tg.key}: marked {blas} "
                                  f"({time.perf_counter() - t:.1f} s)", flush=True)
    print(f"marked {done}, already marked {same}, events differ {differ}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
