"""The engine against the replay across ranks: the shipped presets under every strategy memplan replays, at 2 to 64
GPUs, default and torch-amp recipes, with and without full recompute (bench/replay_consistency.py covers the GPU
cases, all one rank). Both read the same traced step, so their allocated peaks must agree but for the caching
allocator's rounding (a block keeps a remainder of 1 MiB or less, which torch counts as allocated); where they do
not, one of the two has a rule wrong. Its table: docs/replay-consistency-ranks.md.

usage: python bench/replay_consistency_ranks.py [--presets llama-3-8b,...] [--out docs/replay-consistency-ranks.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRESETS = ("llama-3-8b", "mixtral-8x7b", "qwen2.5-7b", "gpt2-xl")
#: (label, options.resolve keywords)
STRATEGIES = (
    ("ddp", dict(strategy="ddp")),
    ("horovod", dict(strategy="horovod")),
    ("zero-optimizer", dict(strategy="zero-optimizer")),
    ("zero1", dict(stage=1)), ("zero2", dict(stage=2)), ("zero3", dict(stage=3)),
    ("zero3 hpz 8", dict(stage=3, hpz_partition_size=8)),
    ("zero2 offload", dict(stage=2, offload_optimizer=True)),
    ("zero3 offload", dict(stage=3, offload_optimizer=True)),
    ("fsdp-full", dict(strategy="fsdp-full")), ("fsdp-grad-op", dict(strategy="fsdp-grad-op")),
    ("fsdp-no-shard", dict(strategy="fsdp-no-shard")), ("hsdp", dict(strategy="hsdp")),
    ("fsdp-full offload", dict(strategy="fsdp-full", cpu_offload=True)),
    ("fsdp1 full", dict(strategy="fsdp-full", fsdp_version=1)),
    ("fsdp1 grad-op", dict(strategy="fsdp-grad-op", fsdp_version=1)),
    ("fsdp1 full offload", dict(strategy="fsdp-full", fsdp_version=1, cpu_offload=True)),
)
GPUS = (2, 8, 64)
RECIPES = (None, "torch-amp")
RECOMPUTE = ("none", "full")


def main() -> None:
    from memplan import accounting, options
    from memplan.request import JobRequest
    from memplan.errors import MemplanError
    from memplan.model import sources

    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--out", default=str(ROOT / "docs" / "replay-consistency-ranks.md"))
    args = ap.parse_args()
    rows, flat, refused = [], [], 0
    t0 = time.perf_counter()
    for name in args.presets.split(","):
        src = sources.resolve(name)
        inv = sources.build_inventory(src, builder="auto")
        for label, kw in STRATEGIES:
            for gpus in GPUS:
                for recipe in RECIPES:
                    for rc in RECOMPUTE:
                        try:
                            job = JobRequest.of(gpus=gpus, gpus_per_node=8, gpu="h100-80g", precision=recipe,
                                                recompute=rc, allocator_conf="", **kw)
                            s = options.resolve(inv, job, config=src.config).settings
                            plan = accounting.estimate(inv, s)
                        except MemplanError:
                            refused += 1  # a combination memplan refuses (one line, exit 2 on the command line)
                            continue
                        key = (name, label, gpus, recipe or "default", rc)
                        if plan.reserved is None:
                            flat.append((key, plan.reserved_why))
                            continue
                        err = (plan.reserved.allocated_bytes - plan.peak_bytes) / plan.peak_bytes
                        rows.append((err, key, plan.peak_bytes, plan.reserved.allocated_bytes))
    dt = time.perf_counter() - t0
    rows.sort(key=lambda r: r[0])
    n = len(rows)
    within = {x: sum(abs(e) <= x / 100 for e, *_ in rows) for x in (0.1, 1, 3)}
    lines = [
        "# The engine against the replay, across ranks", "",
        f"Made by `python bench/replay_consistency_ranks.py` ({dt:.0f} s on {n + len(flat)} configurations, "
        f"{refused} combinations refused): presets {args.presets} x {len(STRATEGIES)} strategies x GPUs "
        f"{', '.join(map(str, GPUS))} (8 per node) x recipe (the strategy's default, torch-amp) x recompute (none, "
        "full), micro-batch 1, sequence 2048, an H100. Difference = (replay's allocated peak - engine's) / "
        "engine's; the replay's figure is torch's max_memory_allocated, which counts the remainder a block keeps "
        "(1 MiB or less), so a few tenths of a percent over is the allocator's, not a rule's.", "",
        f"**{n} replayed, {len(flat)} not (their reserved peak the flat term); difference min {rows[0][0]:+.2%}, "
        f"max {rows[-1][0]:+.2%}; within 0.1%: {within[0.1]}, within 1%: {within[1]}, within 3%: {within[3]}**"
        if rows else "**nothing replayed**", "",
        "The largest differences either way:", "",
        "| preset | strategy | GPUs | recipe | recompute | engine peak | replay's allocated | difference |",
        "|---|---|---:|---|---|---:|---:|---:|"]
    for err, key, peak, alloc in rows[:12] + rows[-12:] if n > 24 else rows:
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]} | {peak:,} | {alloc:,} | {err:+.2%} |")
    if flat:
        lines += ["", "Not replayed:", ""]
        whys: dict[str, int] = {}
        for _, why in flat:
            whys[why] = whys.get(why, 0) + 1
        lines += [f"- {why}: {count}" for why, count in sorted(whys.items())]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"{n} replayed, {len(flat)} flat, {refused} refused, {dt:.0f} s; min {rows[0][0]:+.2%} "
          f"max {rows[-1][0]:+.2%}; within 1%: {within[1]}; wrote {args.out}")


if __name__ == "__main__":
    main()
