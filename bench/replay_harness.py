"""The reserved-peak replays' allocation sequences against the CPU harness's measured peaks.

Each framework's replay (memplan/frameworks/*_replay.py) walks the job's allocations and frees in the order the
framework makes them. On the GPU the caching allocator rounds and caches them; on the CPU harness (gloo, docs/
accuracy.md) every allocation is the CPU allocator's own, so the live bytes the replay's sequence reaches, counted
as requested (no rounding, no cache, no cuBLAS workspace: the CPU has none), must be the harness's measured peak.
This checks the replays' order of events on the real frameworks, row by row of docs/accuracy.jsonl, without a GPU.

    python bench/replay_harness.py [--only fsdp1] [--out docs/replay-harness.md]

The LoRA rows (docs/accuracy-lora.jsonl, bench/accuracy.py lora_cases) are a second table in the same file.

Rows whose framework is not replayed (reserved.why_not: the split-backward pipeline schedules,
stages of fewer blocks than the traced step, ...) are skipped. A pipeline job is replayed rank by rank (its action
list: frameworks/pipeline_replay.py); the row compares the worst rank's. The predictions use the measuring machine's instruction set (index 10 of a row, as bench/accuracy.py
--repredict).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


class _Live:
    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


class CountingAllocator:
    """The allocator's interface (memplan/allocator.py Allocator) over requested bytes: what the CPU allocator of
    the harness holds."""

    _plain = True

    def __init__(self, *_a, **_k) -> None:
        self.reserved = self.peak_reserved = self.allocated = self.peak_allocated = self.retries = 0
        self.step_retries: list[int] = []

    def malloc(self, size: int, stream: int = 0) -> _Live:
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.allocated)
        return _Live(size)

    _malloc_plain = malloc

    def free(self, b: _Live) -> None:
        self.allocated -= b.size

    def empty_cache(self) -> None:
        pass


def replayed_peak(inv, s) -> tuple[str, int] | None:
    """(the replay's name, its steady step's peak of requested bytes) for a CPU job, or None where the job's
    framework is not replayed."""
    from memplan import replay as rp
    from memplan import reserved
    from memplan.allocator import AllocatorConfig

    p = s.parallel
    # each pipeline rank's own replay, the worst rank's peak; an expert-parallel rank's own (the whole model's
    # traced step, its experts units marked)
    if p is not None and (p.pp > 1 or (p.ep > 1 and p.tp == 1 and p.cp == 1)):
        from memplan import accounting

        lay = accounting.layout(inv, s)
        got = [replayed_peak(r_inv, replace(v, micro_batch=s.micro_batch))
               for i, (_, r_inv, _) in enumerate(lay.ranks) for v in lay.at(i)[:1]]
        if any(g is None for g in got):
            return None
        return got[0][0], max(p for _, p in got)
    cuda = replace(s, cluster=replace(s.cluster, device="cuda", blas_workspace_bytes=0))
    if reserved.why_not(cuda, inv) is not None:
        return None
    saved = rp.Allocator
    rp.Allocator = CountingAllocator
    try:
        name, variants = reserved._replayer(s).replay(inv, replace(s, cluster=replace(s.cluster,
                                                                                      blas_workspace_bytes=0)),
                                                      AllocatorConfig())
    finally:
        rp.Allocator = saved
    return name, max(a.steps[-1][0] for a in variants.values())


def main() -> None:
    import accuracy

    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="rows whose label starts with this")
    ap.add_argument("--out", default=str(ROOT / "docs" / "replay-harness.md"))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    tables = [_rows(args, accuracy.CASES, ROOT / "docs" / "accuracy.jsonl"),
              _rows(args, accuracy.lora_cases(), ROOT / "docs" / "accuracy-lora.jsonl")]
    _write(args, tables, time.perf_counter() - t0)


def _rows(args, cases, log: Path) -> list[tuple]:
    from memplan import validation
    from memplan.request import JobRequest

    kept = {}
    for line in log.read_text().splitlines():
        r = json.loads(line)
        kept[(r[0], r[1], r[2])] = r
    inventories = []
    wrapped = validation.adapted_inventory

    def keep(inv, kw):
        out = wrapped(inv, kw)
        inventories.append(out)
        return out

    validation.adapted_inventory = keep
    rows = []
    for label, (model, scale), strat, ds, tk, rc in cases:
        if args.only and not label.startswith(args.only):
            continue
        strat = dict(strat)
        gpus = strat.pop("gpus", 2)
        shown = f"{model}, {scale['layers']} blocks"
        row = kept.get((label, shown, rc))
        if row is None or row[3] is None:
            continue
        isa = row[10] if len(row) > 10 else "avx512"
        job = JobRequest.of(gpus=gpus, gpus_per_node=gpus, micro_batch=2, seq_len=strat.pop("seq_len", 128),
                            recompute=rc, **ds, **{"fsdp_root_reshard": "auto", **tk}, **strat, device="cpu",
                            cpu_isa=isa)
        try:
            plan, resolved, *_ = validation.predict(model, job, **scale)
        except Exception as exc:
            print(f"{label} {shown} {rc}: {exc}", flush=True)
            continue
        got = replayed_peak(inventories[-1], resolved.settings)
        if got is None:
            from memplan import reserved

            s = resolved.settings
            why = reserved.why_not(replace(s, cluster=replace(s.cluster, device="cuda")), inventories[-1])
            print(f"{label:32} {shown:22} {rc:8} not replayed: {why}", flush=True)
            continue
        name, peak = got
        measured = row[4]
        rows.append((label, shown, rc, name, measured, plan.peak_bytes, peak))
        print(f"{label:32} {shown:22} {rc:8} {name:28} measured {measured:>13,} replay {peak:>13,} "
              f"{(peak - measured) / measured:+.2%} (engine {(plan.peak_bytes - measured) / measured:+.2%})",
              flush=True)
    validation.adapted_inventory = wrapped
    return rows


def _write(args, tables, seconds: float) -> None:
    import platform

    import torch

    lines = ["# The replays' allocation sequences against the CPU harness", "",
             f"Produced by `python bench/replay_harness.py{' --only ' + args.only if args.only else ''}` "
             f"({seconds:.0f} s, {platform.machine()}, torch {torch.__version__}) from the measurements kept in "
             "docs/accuracy.jsonl (docs/accuracy.md). Replay = the live bytes the framework's replay "
             "(memplan/frameworks/*_replay.py) reaches in its steady step, counted as requested (the CPU harness "
             "has no caching allocator and no cuBLAS workspace); engine = memplan's allocated peak "
             "(memplan/accounting.py). Error = (predicted - measured) / measured.", "",
             "Rows not listed: the job is not replayed here (tensor and context parallelism: their CPU "
             "profiles are a rank's share without the step's allocation events; pipeline schedules with a split "
             "backward, or stages of fewer blocks than the traced step), or the CPU profile kept no allocation "
             "events (the run prints which). A pipeline job's row is its worst rank's replay (each rank walks its "
             "schedule's action list: memplan/frameworks/pipeline_replay.py; DeepSpeed's PipelineEngine its "
             "TrainSchedule: pipe_engine_replay.py, whose small-bucket row peaks at the CPU optimizer step below); "
             "an expert-parallel job's is its rank's "
             "own traced step with each experts module its own FSDP2 unit (frameworks/fsdp2_replay.py). Traced "
             "afresh (MEMPLAN_CACHE_DIR empty), as these were.",
             "",
             "Known CPU-only differences (the replays model CUDA): DeepSpeed built without its ops steps torch's "
             "single-tensor AdamW on the flat fp32 partition off CUDA, two partition-sized temporaries at the "
             "optimizer step that CUDA's FusedAdam does not make (the engine counts them on CPU: "
             "settings.optimizer_impl), so ZeRO rows that peak there read under; ZeRO-Offload keeps the offloaded "
             "states in the memory the CPU harness measures; a CPU bf16 GEMM's own scratch (kernels.py "
             "cpu_gemm_scratch) is one point of the traced timeline, not an allocation event, so a row whose peak "
             "is that scratch (the 2-block full recompute rows) reads under by it. The FSDP1 row with full "
             "recompute is gloo's held "
             "cast (docs/accuracy.md, session 18); the size:N rows are the grouped units' upper bound "
             "(options.py's note).", "",
             ]
    for title, rows in zip(("docs/accuracy.jsonl", "LoRA: docs/accuracy-lora.jsonl"), tables):
        lines += [f"## {title}", "",
                  "| case | model | recompute | replay | measured | replay's peak | error | engine's error |",
                  "|---|---|---|---|---:|---:|---:|---:|"]
        for label, shown, rc, name, measured, engine, peak in rows:
            lines.append(f"| {label} | {shown} | {rc} | {name} | {measured:,} | {peak:,} | "
                         f"{(peak - measured) / measured:+.2%} | {(engine - measured) / measured:+.2%} |")
        lines.append("")
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
