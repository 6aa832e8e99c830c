"""Replay recorded CUDA caching-allocator event streams through memplan/allocator.py and compare the reserved
peak with the run's measured torch.cuda.max_memory_reserved.

    python bench/allocator_replay.py [--shared ../shared/gpu]

Streams: ../shared/gpu/traces/*.jsonl.gz (4 runs) and bench/gpu/traces/*.jsonl.gz (4 runs of session 10 and 7 of
session 17 on the H100; session 23's 26 runs on an H200: bench/gpu/cases23.tsv and run23c.sh), one JSON array per event, [action, address, size, stream], from before the model is built to the
end of step 4 (lab/gpu-runs/case.py with SNAPSHOT=full:PATH).
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

#: stream file -> the truth line it was recorded with (config, framework, mode, micro-batch, seq, recompute)
STREAMS = {
    "ddp_amp": ("llama-3.2-1b.json", "ddp", "amp", 4, 2048, "none"),
    "fsdp_full_rc": ("llama-3.2-1b.json", "fsdp2", "full", 8, 2048, "full"),
    "zero3_offload": ("llama-3.2-1b.json", "deepspeed",
                      '{"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true}}', 4, 2048, "full"),
    "zero2": ("qwen2.5-0.5b.json", "deepspeed", '{"stage": 1}', 8, 2048, "none"),
    "qwen3_ddp_fp32": ("qwen3-0.6b.json", "ddp", "fp32", 2, 1024, "none"),
    "phi3_fsdp_full": ("phi3-mini-4l.json", "fsdp2", "full", 4, 2048, "none"),
    "phi2_ddp_amp": ("phi-2-6l.json", "ddp", "amp", 4, 2048, "none"),
    "olmo2_fsdp_gradop_rc": ("olmo2-1b.json", "fsdp2", "gradop", 4, 2048, "full"),
    # session 17 (.whl/go.sh with lab/gpu-runs/case.py, SNAPSHOT=full): the runs whose reserved peak the
    # replay missed, and three ZeRO-Offload runs
    "gpt2_z2": ("gpt2.json", "deepspeed", '{"stage": 2}', 16, 1024, "none"),
    "smollm2_ddp": ("smollm2-135m.json", "ddp", "amp", 8, 4096, "none"),
    "olmoe_z3": ("olmoe-2l.json", "deepspeed", '{"stage": 3}', 2, 2048, "full"),
    "l8b_z3": ("llama-3-8b-4l.json", "deepspeed", '{"stage": 3}', 2, 4096, "full"),
    "l1b_z2off": ("llama-3.2-1b.json", "deepspeed",
                  '{"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true}}', 4, 2048, "full"),
    "q05_z2off": ("qwen2.5-0.5b.json", "deepspeed",
                  '{"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true}}', 8, 2048, "none"),
    "q05_z3offpo": ("qwen2.5-0.5b.json", "deepspeed",
                    '{"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true}, "offload_param": '
                    '{"device": "cpu", "pin_memory": true}}', 4, 2048, "none"),
}


def cases_file_streams(path: Path) -> dict[str, tuple]:
    """A device cases file's runs (lab/gpu-runs/run23.sh: name, model, framework, mode, micro-batch, seq,
    recompute, attention[, PYTORCH_CUDA_ALLOC_CONF]), each stream named as its case."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            name, model, fw, mode, mb, seq, rc, _attn, *conf = line.split("\t")
            out[name] = (f"{model}.json", fw, mode, int(mb), int(seq), rc, *(c for c in conf if c))
    return out


STREAMS.update(cases_file_streams(ROOT / "bench" / "gpu" / "cases23.tsv"))
# lab/gpu-runs/run23c.sh: a bare fully_shard(model), and ZeRO-3 with memory_efficient_linear false
STREAMS["l8b_fsdp_rootauto"] = ("llama-3-8b-4l.json", "fsdp2", "full", 2, 4096, "none", "root:auto")
# lab/gpu-runs/run23d.sh: the two DDP runs the replay, as they released their first buckets, is >3% under
STREAMS["olmoe_ddp_amp"] = ("olmoe-2l.json", "ddp", "amp", 4, 2048, "none")
STREAMS["phi2_ddp_fp32"] = ("phi-2-6l.json", "ddp", "fp32", 2, 2048, "none")
STREAMS["q7_z3mb1_aten"] = ("qwen2.5-7b-4l.json", "deepspeed", '{"stage": 3, "memory_efficient_linear": false}', 1, 512,
                            "none")


def measured(shared: Path) -> dict[tuple, int]:
    out = {}
    for path in (shared / "truth.jsonl", ROOT / "bench" / "gpu" / "truth-extra.jsonl"):
        if path.is_file():
            for line in path.read_text().splitlines():
                d = json.loads(line)
                if "reserved_peak_bytes" in d:
                    key = (d["config"], d["framework"], d["mode"], d["micro_batch"], d["seq_len"], d["recompute"])
                    key += ((d["alloc_conf"],) if d.get("alloc_conf") else ())
                    key += ((f"root:{d['fsdp_root_reshard']}",) if d.get("fsdp_root_reshard") else ())
                    out[key] = d["reserved_peak_bytes"]
    return out


def main() -> int:
    from memplan.allocator import AllocatorConfig, replay

    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=str(ROOT.parent / "shared" / "gpu"))
    args = ap.parse_args()
    shared = Path(args.shared)
    truth = measured(shared)
    bad = 0
    for directory in (shared / "traces", ROOT / "bench" / "gpu" / "traces"):
        for path in sorted(directory.glob("*.jsonl.gz")):
            name = path.name.removesuffix(".jsonl.gz")
            events = [json.loads(line) for line in gzip.open(path, "rt")]
            t = time.perf_counter()
            key = STREAMS.get(name, ())
            conf = key[6] if len(key) > 6 and not key[6].startswith("root:") else ""
            a = replay(events, AllocatorConfig.parse(conf))
            want = truth.get(key)
            ok = want is not None and a.peak_reserved == want
            bad += not ok
            print(f"{name:22} {len(events):6} events  replayed max reserved {a.peak_reserved:>15,}  measured "
                  f"{want if want is None else format(want, ','):>15}  {'exact' if ok else 'DIFFERS'}  "
                  f"({time.perf_counter() - t:.2f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
