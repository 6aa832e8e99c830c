"""Every model transformers ships for a task, run on the CPU harness against memplan's prediction: for each
model_type in the task's auto mapping (``--task``: causal-lm, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, by default;
sequence-classification, token-classification, question-answering, masked-lm, seq2seq-lm), the config its class
builds by default (AutoConfig.for_model), the task's class as ``architectures``, scaled to 2 blocks, hidden 256 and
a vocabulary of 2048 (memplan's --layers/--hidden/--vocab), trained for 3 steps by `memplan validate` and compared
at the last one. Writes docs/accuracy-architectures.md (and .jsonl, one line per model type, task and setting,
kept between runs).

    python bench/architectures.py [--task TASK] [--cpu-isa ISA] [--resume] [--setting ddp-amp|fsdp-bf16|zero3-bf16 ...] [--only T ...]

--resume keeps the rows already run and runs the rest; --only runs those model types (again) and keeps the others.

A model type that does not run says why, in one of these words:
- ``config``: transformers' own default config does not build or validate (its class needs fields the defaults
  leave unset, or the scaled config breaks one of the class's checks): not memplan's to run;
- ``refused``: memplan refuses it with a one-line reason (a head or modality memplan does not model);
- ``harness``: the real framework fails on it (DDP's unused-parameter check on an encoder-decoder's decoder);
- ``error``: anything else: memplan's to fix.

This is the breadth check: the architectures memplan is measured on elsewhere (docs/accuracy.md, the GPU tables)
are a few; the traced step follows transformers' modeling code, so a model type it has never seen should run and
come out as close. Each run takes a few seconds; the whole list about 40 minutes a setting on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "docs" / "accuracy-architectures.md"
DATA = ROOT / "docs" / "accuracy-architectures.jsonl"
#: the job settings a model type is run under: (memplan's options, the ranks)
SETTINGS = {
    "ddp-amp": (["--strategy", "ddp", "--precision", "torch-amp"], 1),
    "fsdp-bf16": (["--strategy", "fsdp-full", "--precision", "fsdp-bf16"], 2),
    "zero3-bf16": (["--stage", "3", "--precision", "deepspeed-bf16"], 2),
}
SCALE = ["--layers", "2", "--hidden", "256", "--vocab", "2048"]
CAUSAL = "causal-lm"
#: each task's transformers auto mapping (model_type -> class)
MAPPINGS = {CAUSAL: "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
            "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
            "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
            "question-answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
            "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
            "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"}
JOB = ["--optimizer", "adamw", "--micro-batch", "2", "--seq-len", "128", "--tolerance", "0.01", "--device", "cpu"]


def default_config(model_type: str, cls: str) -> dict | None:
    """transformers' default config of the model type with the task's class named (None where it fails)."""
    from transformers import AutoConfig

    try:
        d = AutoConfig.for_model(model_type).to_dict()
    except Exception:  # noqa: BLE001 - transformers' own defaults fail: reported as "config"
        return None
    d.pop("transformers_version", None)
    return {**d, "architectures": [cls], "model_type": model_type}


def classify(err: str) -> str:
    """The kind of a failed run from memplan's one-line error (see the module docstring)."""
    if "could not build" in err or "is not valid for" in err or "does not know model_type" in err:
        return "config"
    if "rank 0 failed" in err or "rank 1 failed" in err:
        return "harness"
    if err.startswith("Error:") and "internal error" not in err:
        return "refused"
    return "error"


def task_of(row: dict) -> str:
    return row.get("task", CAUSAL)  # rows of the first runs, all causal LMs, name no task


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def run_one(model_type: str, cls: str, setting: str, isa: str | None, timeout: int, task: str = CAUSAL) -> dict:
    cfg = default_config(model_type, cls)
    row = {"model_type": model_type, "class": cls, "setting": setting, **({"task": task} if task != CAUSAL else {}),
           **({"cpu_isa": isa} if isa else {}), "transformers": _transformers_version()}
    if cfg is None:
        return {**row, "outcome": "config", "why": "AutoConfig.for_model fails on its defaults"}
    opts, ranks = SETTINGS[setting]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{model_type}.json"
        path.write_text(json.dumps(cfg, default=str))
        cmd = [sys.executable, "-m", "memplan", "validate", str(path), "--gpus", str(ranks), *opts, *SCALE, *JOB,
               "--json"] + (["--cpu-isa", isa] if isa else [])
        start = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {**row, "outcome": "error", "why": f"no result in {timeout} s"}
        row["seconds"] = round(time.time() - start, 1)
    err = next((ln for ln in reversed(p.stderr.splitlines()) if ln.startswith("Error")), "")
    try:
        out = json.loads(p.stdout)
    except ValueError:
        return {**row, "outcome": classify(err or p.stderr[-300:]), "why": (err or p.stderr[-300:]).strip()[:300]}
    peak = out["validation"]["peak"]
    acts = str((out.get("prediction") or {}).get("assumptions", {}).get("activations", ""))
    return {**row, "outcome": "measured", "activations": acts.split(" ")[0], "predicted": peak["predicted_bytes"], "measured": peak["measured_bytes"],
            "error": peak["error"], "phase": f"{peak['predicted_phase']}/{peak['measured_phase']}",
            "params": out["run"].get("params") if isinstance(out.get("run"), dict) else None}


def render(rows: list[dict], header: str) -> str:
    lines = ["# Accuracy across architectures: every model transformers ships for a task", "", header, ""]
    for task, setting in ((t, k) for t in MAPPINGS for k in SETTINGS):
        mine = sorted((r for r in rows if r["setting"] == setting and task_of(r) == task), key=lambda r: r["model_type"])
        if not mine:
            continue
        done = [r for r in mine if r["outcome"] == "measured"]
        errs = [abs(r["error"]) for r in done]
        within = sum(e <= 0.01 for e in errs)
        analytic = sum(r.get("activations", "traced") != "traced" for r in done)
        worst = max(done, key=lambda r: abs(r["error"]), default=None)
        counts = {k: sum(r["outcome"] == k for r in mine) for k in ("config", "refused", "harness", "error")}
        lines += [f"## {task}, {setting}: `{' '.join(SETTINGS[setting][0])}`, {SETTINGS[setting][1]} rank(s)", "",
                  f"**{len(mine)} model types; {len(done)} measured ({analytic} of them predicted with analytic "
                  f"activations), {within} within 1%"
                  + (f", worst {worst['model_type']} {worst['error']:+.2%}" if worst else "")
                  + f"; not run: {counts['config']} config, {counts['refused']} refused, {counts['harness']} harness, "
                  f"{counts['error']} error**", "",
                  "| model_type | class | predicted peak | measured peak | error | phase (pred/meas) | outcome |",
                  "|---|---|---:|---:|---:|---|---|"]
        for r in mine:
            if r["outcome"] == "measured":
                how = "measured" + ("" if r.get("activations", "traced") == "traced" else
                                    f" ({r.get('activations')} activations: the trace failed)")
                lines.append(f"| {r['model_type']} | {r['class']} | {r['predicted']:,} | {r['measured']:,} | "
                             f"{r['error']:+.2%} | {r['phase']} | {how} |")
            else:
                why = r.get("why", "").replace("|", "/").replace("\n", " ")
                lines.append(f"| {r['model_type']} | {r['class']} | | | | | {r['outcome']}: {why[:160]} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--setting", nargs="*", default=["ddp-amp"], choices=list(SETTINGS))
    ap.add_argument("--task", default=CAUSAL, choices=list(MAPPINGS))
    ap.add_argument("--only", nargs="*", default=None, help="these model types only")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in the .jsonl, run the rest")
    ap.add_argument("--cpu-isa", default=None)
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--render", action="store_true", help="rewrite the table from the .jsonl alone")
    args = ap.parse_args()

    import torch
    from transformers.models.auto import modeling_auto

    mapping = getattr(modeling_auto, MAPPINGS[args.task])
    rows = [json.loads(ln) for ln in DATA.read_text().splitlines() if ln.strip()] if DATA.exists() else []
    have = {(r["model_type"], r["setting"]) for r in rows if task_of(r) == args.task
            and not (args.only and r["model_type"] in args.only)} if args.resume else set()
    if not args.resume and not args.render:  # the settings run again (with --only: those model types' rows)
        rows = [r for r in rows if task_of(r) != args.task or r["setting"] not in args.setting
                or (args.only and r["model_type"] not in args.only)]
    for setting in ([] if args.render else args.setting):
        for model_type, cls in mapping.items():
            cls = cls[0] if isinstance(cls, (list, tuple)) else cls
            if (args.only and model_type not in args.only) or (model_type, setting) in have:
                continue
            row = run_one(model_type, cls, setting, args.cpu_isa, args.timeout, args.task)
            rows = [r for r in rows if (r["model_type"], r["setting"], task_of(r)) != (model_type, setting, args.task)] \
                + [row]
            print(f"{args.task} {setting} {model_type}: {row['outcome']} "
                  + (f"{row['error']:+.2%}" if row["outcome"] == "measured" else row.get("why", "")[:120]), flush=True)
            DATA.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ran = [k for k in SETTINGS if any(r["setting"] == k for r in rows)]
    tasks = [t for t in MAPPINGS if any(task_of(r) == t for r in rows)]
    # the ISA each row ran with (rows before session 45 did not record theirs: avx512_bf16, an AMD EPYC)
    from collections import Counter

    # (and the transformers each ran with: rows before session 45 ran 5.24.0)
    def how(r: dict) -> tuple[str, str]:
        return r.get("cpu_isa", "avx512_bf16"), r.get("transformers", "5.24.0")

    base = Counter(how(r) for r in rows).most_common(1)[0][0]
    again = sorted({f"{r['model_type']} ({task_of(r)}, {how(r)[0]}, transformers {how(r)[1]})"
                    for r in rows if how(r) != base})
    header = (f"Produced by `python bench/architectures.py --task TASK --setting {' '.join(ran)}"
              f" --cpu-isa {base[0]}` for each task ({', '.join(tasks)})"
              + (f" (re-run on another machine: {', '.join(again)})" if again else "") + " "
              f"on x86_64 (2 cores), CPU only: torch "
              f"{torch.__version__}, transformers {base[1]}. Each model type of the task's transformers "
              "auto mapping (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES for causal-lm) is built from its config class's defaults "
              "with the task's class, "
              "scaled to 2 blocks, hidden 256, vocabulary 2048, and trained by `memplan validate` (micro-batch 2, "
              "sequence 128, AdamW, 2 warm-up steps and 1 measured; gloo ranks on one host), against memplan's "
              "prediction for `--device cpu` of the same scaled config. Error = (predicted - measured) / measured. "
              "Not run: `config` (transformers' default config does not build or validate), `refused` (memplan "
              "says why in one line), `harness` (the framework itself fails), `error` (memplan's to fix). See the "
              "script's docstring. ddp-amp runs every model type; fsdp-bf16 and zero3-bf16 the common causal LMs named with "
              "--only.")
    OUT.write_text(render(rows, header))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
