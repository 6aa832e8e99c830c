"""CPU bf16 GEMM scratch: memplan's rule per instruction set (memplan/activations/kernels.py cpu_gemm_scratch) against the
allocator's events of real GEMMs, on this machine and in the measurements kept in bench/cpu/.

    python bench/cpu_gemm_scratch.py            # measure this host, compare every kept measurement, write
                                                 # docs/cpu-kernels.md
    python bench/cpu_gemm_scratch.py --print
    python bench/cpu_gemm_scratch.py --keep NAME    # also keep this host's measurements (1 and 2 threads) as
                                                    # bench/cpu/gemm_scratch_NAME.jsonl
    python bench/cpu_gemm_scratch.py --spot-check   # also: two harness cases under ATEN_CPU_CAPABILITY=avx2,
                                                    # against the measurements kept in docs/accuracy.jsonl

bench/cpu/gemm_scratch_sapphire_rapids.jsonl: the device machine's host CPU (Intel Sapphire Rapids: AMX,
AVX512-BF16), torch 2.11.0, 3 threads, oneDNN capped with ONEDNN_MAX_CPU_ISA at each level (.gpu/gemm_isa.py).
bench/cpu/gemm_scratch_amx_torch2.13.jsonl: a 2-core AMX host (Intel Xeon with amx_bf16, avx512_bf16,
avx512_fp16), torch 2.13.0+cpu, 1 and 2 threads, 485 shapes each (`--keep amx_torch2.13`, session 11).
bench/cpu/gemm_scratch_avx512bf16_zen4_torch2.13.jsonl: a 2-core AMD EPYC (Zen 4: avx512_bf16, no AMX), torch
2.13.0+cpu, 1 and 2 threads, 485 shapes each (`--keep avx512bf16_zen4_torch2.13`, session 12).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CAP_TO_ISA = {None: "amx", "AVX512_CORE_AMX": "amx", "AVX512_CORE_BF16": "avx512_bf16", "AVX512_CORE": "avx512",
              "AVX2": "avx2"}


def measure_host(threads: int = 1) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    rows = []
    shapes = itertools.product([1, 8, 16, 64, 128, 256, 512, 1024, 2048], [8, 64, 128, 256, 512, 1024, 4096],
                               [8, 32, 64, 256, 512, 1024, 2048, 4096])
    for m, n, k in ((m, n, k) for m, n, k in shapes if m * n * k > 16 ** 3):
        a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
        a @ b  # oneDNN creates its primitive on the first call; the second is what a training step repeats
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = a @ b
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        prof.export_chrome_trace(path)
        events = [e["args"]["Bytes"] for e in json.load(open(path))["traceEvents"] if e.get("name") == "[memory]"]
        os.unlink(path)
        rows.append([m, n, k, [x for x in events if x > 0 and x != out.nbytes]])
    return {"threads": threads, "rows": rows}


def compare(isa: str, rows: list, threads: int) -> tuple[int, int, int, int]:
    from memplan.activations.kernels import cpu_gemm_scratch

    exact = under = worst_under = worst_over = 0
    for m, n, k, temps, *_ in rows:
        got, rule = sum(temps), cpu_gemm_scratch(isa, m, n, k, "bfloat16", threads)
        exact += got == rule
        if rule < got:
            under += 1
            worst_under = max(worst_under, got - rule)
        worst_over = max(worst_over, rule - got)
    return exact, under, worst_under, worst_over


SPOT = [("zero2 small buckets", ["--stage", "2", "--reduce-bucket-size", "100000", "--allgather-bucket-size", "100000",
                                  "--no-overlap-comm"]),
        ("fsdp-full", ["--strategy", "fsdp-full"])]


def spot_check() -> list[str]:
    """Two curated harness cases (llama-7b, 2 blocks, 2 ranks) run under ATEN_CPU_CAPABILITY=avx2: another ATen
    kernel set on the same CPU, against the measurement docs/accuracy.jsonl keeps for them."""
    import subprocess

    kept = {}
    for line in (ROOT / "docs" / "accuracy.jsonl").read_text().splitlines():
        r = json.loads(line)
        kept[(r[0], r[1], r[2])] = r
    out = ["", "## The harness under another ATen CPU capability", "",
           "`ATEN_CPU_CAPABILITY=avx2 memplan validate llama-7b --layers 2 --hidden 256 --vocab 2048 --gpus 2 "
           "--micro-batch 2 --seq-len 128 --device cpu ...` (the options below), against the same case's kept "
           "measurement (native capability) in docs/accuracy.jsonl:", "",
           "| case | measured (avx2) | measured (kept) | predicted | error |", "|---|---:|---:|---:|---:|"]
    for label, extra in SPOT:
        cmd = [sys.executable, "-m", "memplan", "validate", "llama-7b", "--layers", "2", "--hidden", "256", "--vocab",
               "2048", "--gpus", "2", "--micro-batch", "2", "--seq-len", "128", "--device", "cpu", "--json", *extra]
        env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", OMP_NUM_THREADS="1")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        peak = json.loads(r.stdout)["validation"]["peak"]
        old = kept.get((label, "llama-7b, 2 blocks", "none"))
        out.append(f"| {label} `{' '.join(extra)}` | {peak['measured_bytes']:,} | "
                   f"{old[4]:,} | {peak['predicted_bytes']:,} | {100 * peak['error']:+.3f}% |")
    return out


def main() -> None:
    import platform

    import torch

    from memplan.activations.kernels import host_cpu_isa

    ap = argparse.ArgumentParser()
    ap.add_argument("--print", action="store_true")
    ap.add_argument("--spot-check", action="store_true")
    ap.add_argument("--keep", default=None, help="keep this host's measurements as bench/cpu/gemm_scratch_KEEP.jsonl")
    args = ap.parse_args()
    lines = []
    host = host_cpu_isa()
    name = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    data = measure_host()
    table = [("this machine: " + name, f"native ({torch.backends.cpu.get_cpu_capability()})", host, 1,
              len(data["rows"]), *compare(host, data["rows"], 1))]
    if args.keep:
        two = measure_host(2)
        kept = [{"isa": None, "host_isa": host, "threads": d["threads"], "torch": torch.__version__, "cpu": name,
                 "rows": d["rows"]}
                for d in (data, two)]
        (ROOT / "bench" / "cpu" / f"gemm_scratch_{args.keep}.jsonl").write_text(
            "".join(json.dumps(d) + "\n" for d in kept))
    for path in sorted((ROOT / "bench" / "cpu").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.startswith("{"):
                continue
            d = json.loads(line)
            isa = d.get("host_isa", "amx") if d["isa"] is None else CAP_TO_ISA[d["isa"]]
            table.append((path.stem, f"ONEDNN_MAX_CPU_ISA={d['isa'] or '(none)'}", isa, d["threads"], len(d["rows"]),
                          *compare(isa, d["rows"], d["threads"])))
    lines += ["# CPU kernels: what a bf16 GEMM allocates, by instruction set", "",
              f"Made by `python bench/cpu_gemm_scratch.py` on {platform.machine()} ({name}), torch {torch.__version__}. "
              "Each row compares memplan's rule (memplan/activations/kernels.py `cpu_gemm_scratch`) with the CPU allocator's events "
              "of real `a @ b` GEMMs (the profiler's memory events, as the harness measures), less the output. The "
              "rule is what `--device cpu` adds to a traced step for `--cpu-isa` (default: this machine's class, "
              "read from /proc/cpuinfo as PyTorch's mkldnn_bf16_device_check decides).", "",
              "| measured on | oneDNN cap | rule (--cpu-isa) | threads | GEMMs | exact | rule below | worst below (B) "
              "| worst above (B) |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in table:
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
    lines += ["", "Reading: `avx2` (no oneDNN bf16: PyTorch's own kernel) allocates nothing; `avx512` (AVX512 without "
              "bf16 instructions) an fp32 buffer of the output plus 128 bytes, off by up to 512 bytes for dims that "
              "are not multiples of 16; `amx` per-thread packing buffers whose blocks oneDNN chooses from the CPU's "
              "caches, so the rule is an upper bound (exact to 1 KiB where B is packed whole; never below on either "
              "host); `avx512_bf16` a packed block of B and an fp32 accumulator of up to 256 rows, exact on a native "
              "AVX512-BF16 host (AMD Zen 4) for m <= 256 at one thread and an upper bound elsewhere. The quick test "
              "suite checks the rule of whatever machine it runs on (tests/activations/test_tracing.py "
              "`test_cpu_gemm_scratch_rule_matches_this_host`) and passed under ATEN_CPU_CAPABILITY=avx2 and =default "
              "as well as natively (259 tests, session 10; natively on the AMX host, session 11; natively on the "
              "AMD EPYC Zen 4 host, session 12)."]
    if args.spot_check:
        lines += spot_check()
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.print:
        (ROOT / "docs" / "cpu-kernels.md").write_text(text)


if __name__ == "__main__":
    main()
