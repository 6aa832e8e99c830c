"""torch.compile on the CPU: real inductor against the rules memplan's trace runs compiled graphs by
(memplan/activations/tracing/compiled.py), on real tensors, for a small llama with each block compiled.

    python bench/compile_rules.py        # ~2 minutes on 2 cores

Each case runs in its own process: the llama (2 blocks, hidden 256, 4 heads, vocabulary 2048) trains two steps,
then a third under the CPU allocator's profiler (memplan/harness/measure.py), and the step's peak over its start
is printed for eager, for each block compiled by inductor (its C++ kernels), and for each block compiled by
inductor's pipeline up to its partitioner with memplan's Graph running the partitioned graphs. On real tensors
every intermediate is real memory, so "rules" equal to "inductor" says the partition and the buffer lifetimes
agree where the step peaks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CASES = [("float32", 2, 256), ("bfloat16", 2, 256), ("float32", 4, 1024), ("bfloat16", 4, 1024)]


def _one(mode: str, dtype: str, batch: int, seq: int) -> dict[str, int]:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import LlamaConfig, LlamaForCausalLM

    from memplan.harness.measure import follow_all_threads, steps_from_trace

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=2048)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    if mode != "eager":
        from memplan.activations.tracing.compiled import inductor_backend

        backend = "inductor" if mode == "inductor" else inductor_backend
        for blk in model.model.layers:
            blk.forward = torch.compile(blk.forward, backend=backend, fullgraph=True)
    ids = torch.randint(0, 2048, (batch, seq))

    def step() -> None:
        with record_function("memplan:forward"):
            out = model(input_ids=ids, labels=ids)
        with record_function("memplan:backward"):
            out.loss.backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(2):
        step()
    follow_all_threads()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, record_function("memplan:step0"):
        step()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        m = steps_from_trace(path)[0]
    return {"peak": m.peak_bytes - m.start_bytes,
            **{k: v - m.start_bytes for k, v in m.phase_peaks.items()}}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(json.dumps(_one(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print("| dtype | batch x seq | eager | inductor | memplan's rules | rules - inductor |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype, batch, seq in CASES:
        got = {}
        for mode in ("eager", "inductor", "rules"):
            r = subprocess.run([sys.executable, __file__, "--one", mode, dtype, str(batch), str(seq)],
                               capture_output=True, text=True, env=env, check=True)
            got[mode] = json.loads(r.stdout.strip().splitlines()[-1])["peak"]
        print(f"| {dtype} | {batch} x {seq} | {got['eager']:,} | {got['inductor']:,} | {got['rules']:,} | "
              f"{got['rules'] - got['inductor']:+,} |", flush=True)


if __name__ == "__main__":
    main()
