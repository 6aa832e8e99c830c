"""Each pipeline rank's allocated peak (the engine, memplan/accounting.py Layout) against its own replay (the rank's
action list walked through the caching allocator, memplan/frameworks/pipeline_replay.py), for every schedule
torch.distributed.pipelining runs, at a scale the CPU harness does not reach. Both read the same traced stages; the
replay walks the schedule action by action, the engine takes the backwards that can peak
(parallel.backward_moments), so where they part, one of the two has a rule wrong (session 48 found a rank of several
stages counted the last stage's logits on every micro-batch, every stage's accumulators from the second backward
on, and the current micro-batch at all of its blocks). Its table: docs/pipeline-ranks.md.

usage: python bench/pipeline_ranks.py [--model llama-3-8b] [--out docs/pipeline-ranks.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: (schedule, stages per rank)
SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("looped-bfs", 2), ("interleaved-zb", 2), ("zbv", 2),
             ("dualpipev", 2))
GPUS, PP, MICRO_BATCHES, SEQ = 8, 4, 8, 4096


def rows(model: str) -> list[tuple[str, int, int, int]]:
    """(schedule, pipeline rank, the engine's allocated peak, the replay's)."""
    from memplan import frameworks, reserved
    from memplan.parallel import Parallel
    from memplan.request import JobRequest
    from memplan.validation import predict

    out = []
    for schedule, vpp in SCHEDULES:
        job = JobRequest.of(device="cuda", gpu="h100-80g", gpus=GPUS, strategy="fsdp-full", recompute="none",
                            micro_batch=1, grad_accum=MICRO_BATCHES, seq_len=SEQ,
                            parallel=Parallel(pp=PP, schedule=schedule, vpp=vpp if vpp > 1 else None))
        plan = predict(model, job)[0]
        lay = plan.layout
        for i, (_, r_inv, _) in enumerate(lay.ranks):
            v = lay.at(i)[0]
            res = reserved.predict(frameworks.with_unreached(r_inv, v), replace(v, micro_batch=1))
            out.append((schedule, i, lay.plans[i].peak_bytes, res.allocated_bytes if res is not None else 0))
            print(schedule, i, out[-1][2:], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--out", default=str(ROOT / "docs" / "pipeline-ranks.md"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    got = rows(args.model)
    lines = [
        "# Each pipeline rank: the engine against its replay",
        "",
        f"Produced by `python bench/pipeline_ranks.py --model {args.model}` ({time.perf_counter() - t0:.0f} s, "
        f"torchtitan's layout, FSDP2, {GPUS} GPUs, pp {PP}, {MICRO_BATCHES} micro-batches of 1 x {SEQ} tokens, no "
        "recompute, an H100). Engine = the rank's allocated peak (memplan/accounting.py Layout); replay = the "
        "allocated peak of its action list walked through the caching allocator "
        "(memplan/frameworks/pipeline_replay.py). The replay of the split-backward schedules (interleaved-zb, zbv, "
        "dualpipev) is itself approximate (which of the graph's tensors only the input gradient needed is not "
        "known from the traced step); the CPU harness's rows (docs/accuracy.md) measure both.",
        "",
        "| schedule | pipeline rank | engine | replay | engine - replay |",
        "|---|---:|---:|---:|---:|",
    ]
    for schedule, i, eng, rep in got:
        diff = f"{100 * (eng - rep) / rep:+.2f}%" if rep else "not replayed"
        lines.append(f"| {schedule} | {i} | {eng:,} | {rep:,} | {diff} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
