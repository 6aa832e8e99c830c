"""Speed benchmarks (scripts, not timed tests). Writes nothing; prints a markdown table to paste in docs/.

    python bench/speed.py [--repeat 5]

1. Whole-process cold wall time (median of N fresh processes) of:
   - memplan inspect llama-7b / memplan estimate llama-7b --gpus 8 --stage 3
   - an estimate at a sequence length that is not shipped: fitted (issue 21's target: 0.5 s), and traced
   - counting parameters by instantiating transformers' LlamaForCausalLM on the meta device (import included)
   - DeepSpeed's estimate_zero3_model_states_mem_needs_all_cold, when deepspeed is installed
2. In-process configuration evaluations per second: accounting.estimate (a full Plan each) and the batched
   evaluator accounting.required_bytes (the planner's path: exact peak and required bytes per configuration).
3. What --explain and the 'to fit' suggestions add to an estimate, in process (issue 21's targets: 50 ms, 1 s).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

META_COUNT = (
    "import json, torch, transformers\n"
    "cfg = transformers.AutoConfig.for_model(**{k: v for k, v in json.load(open('presets/models/llama-2-7b.json'))"
    ".items()})\n"
    "with torch.device('meta'):\n    m = transformers.AutoModelForCausalLM.from_config(cfg)\n"
    "print(sum(p.numel() for p in m.parameters()))\n")
DS_COLD = (
    "from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold\n"
    "estimate_zero3_model_states_mem_needs_all_cold(total_params=6738415616, largest_layer_params=202383360, "
    "num_gpus_per_node=8, num_nodes=1)\n")


#: jobs no single change fits, whose suggestions search the combinations (tests/cli/test_advice.py has them too)
COMBINATION_JOBS = (["llama-3-8b", "--gpus", "2", "--stage", "2", "--seq-len", "8192", "--micro-batch", "2", "--gpu",
                     "a100-40g"],
                    ["llama-3-8b", "--gpus", "2", "--strategy", "fsdp-full", "--lora-rank", "16", "--precision",
                     "pure-bf16", "--micro-batch", "4", "--gpu", "rtx4090-24g"])

MP_405B = [sys.executable, "-m", "memplan", "estimate", "llama-3.1-405b", "--gpus", "1024", "--tp", "8", "--pp", "16",
           "--strategy", "fsdp-full", "--grad-accum", "16"]


def wall(cmd: list[str], repeat: int, fresh_cache: bool = False, warm: bool = False) -> float:
    """Median wall time; ``fresh_cache``: every run starts with an empty activation-profile cache; ``warm``: one
    run first, not timed (it traces what the cache lacks)."""
    import os
    import tempfile

    if warm:
        subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    times = []
    for _ in range(repeat):
        env = dict(os.environ)
        if fresh_cache:
            env["MEMPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="memplan-bench-")
        t = time.perf_counter()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - t)
        if r.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr[-500:]}")
    return statistics.median(times)


def evals_per_second(seconds: float = 3.0) -> float:
    sys.path.insert(0, str(ROOT))
    from memplan import accounting as A
    from memplan.model import sources
    from memplan.precision import get_optimizer, get_recipe
    from memplan.strategies import DEFAULT_RECIPE, STRATEGIES

    inv = sources.build_inventory(sources.resolve("llama-7b"))
    configs = []
    for name, st in STRATEGIES.items():
        if st.one_gpu:
            continue
        for gpus in (8, 16, 64):
            for mb in (1, 2, 4, 8):
                configs.append(A.Settings(strategy=st, recipe=get_recipe(DEFAULT_RECIPE[st.framework]),
                                          optimizer=get_optimizer("adamw"),
                                          cluster=A.Cluster(gpus=gpus, gpus_per_node=8), micro_batch=mb))
    for s in configs:  # warm caches (layouts per shard count), as the planner would
        A.estimate(inv, s)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for s in configs:
            A.estimate(inv, s)
        n += len(configs)
    return n / (time.perf_counter() - t0)


def batched_evals_per_second(seconds: float = 3.0, lower_bound: bool = True) -> float:
    """The planner's path: accounting.required_bytes over micro-batches 1-64 for each strategy x GPU count
    (traced activation profile of the preset, as `memplan plan` uses). Each evaluation is one configuration's
    exact peak and required bytes (tests/plan/test_planner.py checks they equal estimate()). ``lower_bound``:
    without the caching allocator's replay (the bound the search bisects with); False replays every micro-batch
    (what a search does only for the candidates that could be the best)."""
    sys.path.insert(0, str(ROOT))
    from memplan import accounting as A
    from memplan import options
    from memplan.request import JobRequest
    from memplan.model import sources
    from memplan.strategies import STRATEGIES

    src = sources.resolve("llama-7b")
    inv = sources.build_inventory(src)
    mbs = list(range(1, 65))
    configs = [options.resolve(inv, JobRequest.of(gpus=gpus, strategy=name, gpu="h100-80g"),
                               config=src.config).settings
               for name, row in STRATEGIES.items() if not row.one_gpu for gpus in (8, 16, 64)]
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for s in configs:
            A.required_bytes(inv, s, mbs, lower_bound=lower_bound)
        n += len(configs) * len(mbs)
    return n / (time.perf_counter() - t0)


def explain_and_suggest_ms(repeat: int = 20) -> tuple[float, float]:
    """In process, the job's profile cached: (milliseconds --explain adds to an estimate, milliseconds the 'to fit'
    suggestions add) for llama-3-8b under DDP on 8 H100s, which does not fit (median of ``repeat``)."""
    sys.path.insert(0, str(ROOT))
    from memplan import accounting as A
    from memplan import advice, options
    from memplan.request import JobRequest
    from memplan.explain import explain, summary
    from memplan.model import sources

    src = sources.resolve("llama-3-8b")
    inv = sources.build_inventory(src)

    def settings(changes: dict) -> object:
        kw = {"gpus": 8, "strategy": "ddp", "gpu": "h100-80g", **changes}
        if kw.get("stage") is not None:
            kw.pop("strategy")
        else:
            kw.pop("stage", None)
        if kw.get("strategy") is None:
            kw.pop("strategy", None)
        trace = kw.pop("_trace", True)
        return options.resolve(inv, JobRequest.of(**kw), config=src.config, trace=trace).settings

    plan = A.estimate(inv, settings({}))
    ex_t, sug_t = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        summary(explain(plan))
        ex_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        advice.suggest(plan, lambda ch: (inv, settings(ch)))
        sug_t.append(time.perf_counter() - t)
    return 1000 * statistics.median(ex_t), 1000 * statistics.median(sug_t)


PLAN_SEARCH = (
    "import sys, time\n"
    "from memplan import planner\n"
    "from memplan.request import JobRequest\n"
    "from memplan.model import sources\n"
    "src = sources.resolve(sys.argv[1]); inv = sources.build_inventory(src); config = sources.trace_config(src, inv)\n"
    "if sys.argv[2] == 'bound':  # the search without the allocator's replay: each candidate's bound answer\n"
    "    planner._exact_largest = lambda inv, s, mbs, budget, bound, hi: (hi, 0)\n"
    "t = time.perf_counter(); found = planner.search(inv, JobRequest.of(gpu='h100-80g'), config=config)\n"
    "print(time.perf_counter() - t, found.gpus)\n")


def plan_replay_cost(model: str, repeat: int) -> tuple[float, float, int, int]:
    """Issue 23's bound: `memplan plan MODEL --gpu h100-80g`'s search (in process, after the imports and the
    profile load, a fresh process each time), with the reserved replay and with each candidate's allocated bound
    taken as its answer instead (what the search cost before the replay). Medians of ``repeat``; and the GPU
    counts each answers."""
    out = {}
    for mode in ("replay", "bound"):
        runs = [subprocess.run([sys.executable, "-c", PLAN_SEARCH, model, mode], capture_output=True, text=True,
                               cwd=ROOT, check=True).stdout.split() for _ in range(repeat)]
        out[mode] = (statistics.median(float(r[0]) for r in runs), int(runs[0][1]))
    return out["replay"][0], out["bound"][0], out["replay"][1], out["bound"][1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--llm-analysis-python", help="python of a separate venv with llm-analysis (it pins "
                    "transformers<5): python3 -m venv /tmp/llmvenv && /tmp/llmvenv/bin/pip install llm-analysis")
    args = ap.parse_args()
    py = sys.executable
    rows = [("memplan inspect llama-7b", wall([py, "-m", "memplan", "inspect", "llama-7b"], args.repeat)),
            ("memplan estimate llama-7b --gpus 8 --stage 3",
             wall([py, "-m", "memplan", "estimate", "llama-7b", "--gpus", "8", "--stage", "3"], args.repeat)),
            ("memplan estimate llama-7b --gpus 8 --stage 3 --seq-len 3000, empty profile cache (fitted from the "
             "shipped lengths: no trace)",
             wall([py, "-m", "memplan", "estimate", "llama-7b", "--gpus", "8", "--stage", "3", "--seq-len", "3000"],
                  args.repeat, fresh_cache=True)),
            ("memplan estimate mistral-7b --gpus 8 --strategy fsdp-full --seq-len 20000, empty profile cache "
             "(fitted)",
             wall([py, "-m", "memplan", "estimate", "mistral-7b", "--gpus", "8", "--strategy", "fsdp-full",
                   "--seq-len", "20000"], args.repeat, fresh_cache=True)),
            ("memplan estimate llama-7b --gpus 8 --stage 3 --seq-len 3000 --precision fp32, empty profile cache "
             "(not shipped: traces, torch + transformers import included)",
             wall([py, "-m", "memplan", "estimate", "llama-7b", "--gpus", "8", "--stage", "3", "--seq-len", "3000",
                   "--precision", "fp32"], args.repeat, fresh_cache=True)),
            ("memplan estimate llama-7b --gpus 8 --stage 3 --activations analytic (no profile read)",
             wall([py, "-m", "memplan", "estimate", "llama-7b", "--gpus", "8", "--stage", "3", "--activations",
                   "analytic"], args.repeat)),
            ("memplan estimate llama-3.1-405b --gpus 1024 --tp 8 --pp 16 --strategy fsdp-full --grad-accum 16 "
             "(issue 17: < 0.5 s; each rank's traced profile cached by a first run)",
             wall(MP_405B, args.repeat, warm=True)),
            *[(f"memplan estimate {' '.join(job)}{' --no-suggestions' if off else ''} (no single change fits: "
               f"{'without' if off else 'with'} the combination search; issue 45: it adds at most 0.5 s)",
               wall([py, "-m", "memplan", "estimate", *job, *(["--no-suggestions"] if off else [])], args.repeat,
                    warm=True))
              for job in COMBINATION_JOBS for off in (True, False)],
            ("memplan plan llama-70b --gpu h100-80g (244 configurations)",
             wall([py, "-m", "memplan", "plan", "llama-70b", "--gpu", "h100-80g"], args.repeat)),
            ("count by meta-device instantiation (torch + transformers import)",
             wall([py, "-c", META_COUNT], args.repeat))]
    try:
        import deepspeed  # noqa: F401
        rows.append(("DeepSpeed estimate_zero3_model_states_mem_needs_all_cold", wall([py, "-c", DS_COLD],
                                                                                     args.repeat)))
    except ImportError:
        rows.append(("DeepSpeed estimator", float("nan")))
    if args.llm_analysis_python:
        rows.append(("llm-analysis train, Llama-2-7b, 8 x h100-sxm-80gb, ds_zero 3 (its own venv)",
                     wall([args.llm_analysis_python, "-m", "llm_analysis.analysis", "train", "--model_name",
                           "NousResearch_Llama-2-7b-hf", "--gpu_name", "h100-sxm-80gb", "--total_num_gpus", "8",
                           "--ds_zero", "3", "--batch_size_per_gpu", "1", "--seq_len", "2048", "--log_level",
                           "ERROR"], args.repeat)))
    print(f"| command (whole process, median of {args.repeat}) | wall time |\n|---|---:|")
    for name, secs in rows:
        print(f"| {name} | {secs:.3f} s |")
    print(f"\nin-process accounting.estimate evaluations per second (a full Plan each): {evals_per_second():,.0f}")
    print(f"in-process batched evaluator (accounting.required_bytes, the planner's path) evaluations per second: "
          f"{batched_evals_per_second():,.0f} as the search bisects (the allocated bound, no replay); "
          f"{batched_evals_per_second(lower_bound=False):,.0f} with every micro-batch replayed")
    for model in ("llama-70b", "llama-3-8b"):
        rep, bound, g_rep, g_bound = plan_replay_cost(model, args.repeat)
        print(f"plan {model} --gpu h100-80g, the search in process (median of {args.repeat} fresh processes): "
              f"{rep:.3f} s with the reserved replay ({g_rep} GPUs), {bound:.3f} s on the allocated bound alone "
              f"({g_bound} GPUs): {rep / bound:.2f}x (issue 23: at most 2x)")
    ex_ms, sug_ms = explain_and_suggest_ms()
    print(f"in-process, llama-3-8b DDP on 8 x h100-80g (does not fit), profile cached: --explain adds {ex_ms:.1f} ms "
          f"(target < 50 ms); the 'to fit' suggestions add {sug_ms:.0f} ms (target < 1 s)")


if __name__ == "__main__":
    main()
