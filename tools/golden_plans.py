"""Golden plans: the schema-v1 JSON of every shipped preset x strategy x recipe x GPU count x recompute, so that a
change meant to move code and not numbers can be checked byte for byte (tests/house/test_golden.py).

    python tools/golden_plans.py            # writes tests/data/golden_plans.json.gz
    python tools/golden_plans.py --check    # compares with it, prints the first differences, exit 1 if any

The matrix uses only shipped activation profiles (default sequence length, H100 kernels), so it never traces.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOLDEN = ROOT / "tests" / "data" / "golden_plans.json.gz"
#: the predictions for every measured case (docs/accuracy*.jsonl on CPU, the H100 runs of ../shared/gpu and
#: bench/gpu); these trace small models (a few minutes the first time, then cached)
GOLDEN_ACCURACY = ROOT / "tests" / "data" / "golden_accuracy.json.gz"
GPUS = (1, 2, 8, 64)
RECOMPUTE = ("none", "full")
#: strategy name, FSDP version (FSDP1 is the FSDP2 rows under --fsdp-version 1)
STRATEGIES = (("ddp", 2), ("zero0", 2), ("zero1", 2), ("zero2", 2), ("zero3", 2), ("zero-optimizer", 2),
              ("fsdp-full", 2), ("fsdp-grad-op", 2), ("fsdp-no-shard", 2), ("hsdp", 2),
              ("fsdp-full", 1), ("fsdp-grad-op", 1), ("fsdp-no-shard", 1), ("hsdp", 1))
#: recipes with shipped traces: each strategy's default, and torch-amp under every strategy
RECIPES = (None, "torch-amp")


def cases(presets: list[str] | None = None) -> list[tuple[str, str, int, str | None, int, str]]:
    from memplan.model import sources

    out = []
    for name in presets or sources.preset_names():
        for strategy, version in STRATEGIES:
            for recipe in RECIPES:
                for gpus in GPUS:
                    for rc in RECOMPUTE:
                        out.append((name, strategy, version, recipe, gpus, rc))
    return out


def key(case: tuple) -> str:
    name, strategy, version, recipe, gpus, rc = case
    return f"{name}|{strategy}|fsdp{version}|{recipe or 'default'}|{gpus}|{rc}"


def plan_json(case: tuple, cache: dict) -> str:
    from memplan import accounting, options
    from memplan.request import JobRequest
    from memplan.model import sources
    from memplan.report import plan_report

    name, strategy, version, recipe, gpus, rc = case
    if name not in cache:
        src = sources.resolve(name)
        cache[name] = (src, sources.build_inventory(src, builder="auto"))
    src, inv = cache[name]
    resolved = options.resolve(inv, JobRequest.of(gpus=gpus, strategy=strategy, precision=recipe, recompute=rc,
                                                  gpu="h100-80g", allocator_conf="", fsdp_version=version),
                               config=src.config)
    plan = accounting.estimate(inv, resolved.settings)
    report = plan_report(plan, resolved.sources, resolved.notes)
    # where the profile came from (traced now, or the cache a previous plan filled) is not the plan's: a preset
    # whose profile is not shipped (the vision-language ones) is traced by whichever case comes first
    acts = report.get("assumptions", {}).get("activations")
    if isinstance(acts, str):
        report["assumptions"]["activations"] = acts.replace("(traced now; ", "(").replace("(cache; ", "(")
    return json.dumps(report, sort_keys=True)


def compute(presets: list[str] | None = None) -> dict[str, str]:
    cache: dict = {}
    return {key(c): plan_json(c, cache) for c in cases(presets)}


def accuracy_predictions(shared: Path | None = None, gpu: bool = True) -> dict[str, str]:
    """Every measured case's prediction (peak, phase, reserved), keyed by the case; the CPU cases only where
    ``gpu`` is false (the GPU cases read their configs from ../shared/gpu/configs)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import accuracy as cpu_bench  # bench/accuracy.py
    import gpu_accuracy as gpu_bench  # bench/gpu_accuracy.py
    from memplan.request import JobRequest
    from memplan.validation import predict

    out: dict[str, str] = {}
    for cases in (cpu_bench.CASES, cpu_bench.cross_cases()):
        for label, (model, scale), strat, ds, tk, rc in cases:
            strat = dict(strat)
            gpus = strat.pop("gpus", 2)
            seq = strat.pop("seq_len", 128)
            job = JobRequest.of(device="cpu", cpu_isa="avx512", gpus=gpus, gpus_per_node=gpus, micro_batch=2,
                                seq_len=seq, recompute=rc, **ds,
                                **{"fsdp_root_reshard": "auto", **tk},  # as bench/accuracy.py measures
                                **strat)
            plan = predict(model, job, **scale)[0]
            out[f"cpu|{label}|{model}|{scale['layers']}|{rc}"] = json.dumps(
                [plan.peak_bytes, plan.peak.name, [p.total_bytes for p in plan.phases]])
    if not gpu:
        return out
    shared = shared or ROOT.parent / "shared" / "gpu"
    dirs = [shared / "configs", gpu_bench.EXTRA / "configs"]
    for case in gpu_bench.load_cases(shared) + gpu_bench.load_oom(shared):
        k = "gpu|" + "|".join(str(case.get(f, "")) for f in ("config", "framework", "mode", "micro_batch",
                                                               "seq_len", "recompute", "attn", "alloc_conf"))
        gpu = case.get("versions", {}).get("gpu", "")
        if gpu and "H100" not in gpu:  # a case measured on another GPU (an H200) beside the H100's
            k += "|" + gpu
        if case.get("fsdp_root_reshard"):
            k += "|root:" + case["fsdp_root_reshard"]
        p = gpu_bench.predict(case, dirs)
        out[k] = json.dumps([p["peak_bytes"], p["phase"], p["reserved_peak_bytes"], p["reserved_variants"]],
                            sort_keys=True)
    return out


def load(path: Path = GOLDEN) -> dict[str, str]:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


def _write(path: Path, got: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(path, "wb", mtime=0) as fh:
        fh.write(json.dumps(got, sort_keys=True, indent=0).encode())


def _print_diff(want: dict[str, str], got: dict[str, str], bad: list[str]) -> None:
    """The differing plans' peaks (per_gpu.peak_bytes), stored and now, the largest relative change first."""
    rows = []
    for k in bad:
        if k not in want or k not in got:
            print("only in one:", k)
            continue
        a, b = json.loads(want[k])["per_gpu"], json.loads(got[k])["per_gpu"]
        rows.append((abs(b["peak_bytes"] - a["peak_bytes"]) / a["peak_bytes"], k, a, b))
    rows.sort(reverse=True)
    for rel, k, a, b in rows[:25]:
        sign = "+" if b["peak_bytes"] >= a["peak_bytes"] else "-"
        print(f"{k}: peak {a['peak_bytes']:,} -> {b['peak_bytes']:,} ({sign}{100 * rel:.3f}%), "
              f"{a['peak_phase']} -> {b['peak_phase']}")
    up = sum(1 for _, _, a, b in rows if b["peak_bytes"] > a["peak_bytes"])
    down = sum(1 for _, _, a, b in rows if b["peak_bytes"] < a["peak_bytes"])
    print(f"peaks up: {up}, down: {down}, unchanged: {len(rows) - up - down}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--accuracy", action="store_true", help="the measured cases' predictions instead")
    ap.add_argument("--diff", action="store_true",
                    help="with --check: each differing plan's peak, stored and now, the largest changes first")
    args = ap.parse_args()
    path = GOLDEN_ACCURACY if args.accuracy else GOLDEN
    t0 = time.perf_counter()
    got = accuracy_predictions() if args.accuracy else compute()
    dt = time.perf_counter() - t0
    if args.check:
        want = load(path)
        bad = [k for k in want if got.get(k) != want[k]] + [k for k in got if k not in want]
        if args.diff and not args.accuracy:
            _print_diff(want, got, bad)
        for k in bad[:10]:
            print("differs:", k)
        print(f"{len(got)} plans in {dt:.1f} s; {len(bad)} differ")
        sys.exit(1 if bad else 0)
    _write(path, got)
    print(f"{len(got)} plans in {dt:.1f} s -> {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
