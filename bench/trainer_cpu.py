"""The HF Trainer itself on CPU against `memplan estimate --training-args`: transformers' Trainer.train() runs a
few steps of a scaled-down model under torch's CPU profiler (the allocator's live bytes, as the harness measures:
memplan/harness/measure.py), and memplan predicts the same job for `--device cpu`. Writes
docs/accuracy-trainer.md.

    python bench/trainer_cpu.py [--cpu-isa ISA]

The Trainer runs on this machine, so memplan predicts for this machine's instruction set (host_cpu_isa: oneDNN's
bf16 GEMM scratch differs between avx512, avx512_bf16 and amx, and a full-recompute step peaks beside a GEMM);
--cpu-isa overrides it only to see what another rule would say.

Each case: a preset (or a test config: T5 and BART, 2 encoder and 2 decoder blocks, 64 labels per sample,
AutoModelForSeq2SeqLM) scaled to 2 blocks, hidden 256, vocabulary 2048, its config's dtype as given (transformers 5
loads a model in it: from_pretrained dtype="auto", and from_config the same), the Trainer's defaults (adamw_torch_fused,
max_grad_norm 1.0) with the TrainingArguments shown, sequence 128, 3 steps; the last step's peak is compared.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQ = 128
#: (preset, its config dtype for the run, TrainingArguments)
CASES = [
    ("llama-3-8b", "bfloat16", {"per_device_train_batch_size": 2, "bf16": True}),
    ("llama-3-8b", "bfloat16", {"per_device_train_batch_size": 2}),
    ("llama-3-8b", "bfloat16", {"per_device_train_batch_size": 2, "bf16": True, "gradient_checkpointing": True}),
    ("llama-3-8b", "float32", {"per_device_train_batch_size": 2, "bf16": True}),
    ("llama-3-8b", "float16", {"per_device_train_batch_size": 2, "bf16": True}),
    ("gpt2", "float32", {"per_device_train_batch_size": 2}),
    ("gpt2", "bfloat16", {"per_device_train_batch_size": 2, "bf16": True}),
    ("llama-3-8b", "bfloat16", {"per_device_train_batch_size": 2, "bf16": True, "gradient_accumulation_steps": 2}),
    # encoder-decoders (model/tasks.py SEQ2SEQ): 128 tokens in, TARGET labels out
    ("tests/data/configs/flan-t5-base.json", "float32", {"per_device_train_batch_size": 2}),
    ("tests/data/configs/flan-t5-base.json", "bfloat16", {"per_device_train_batch_size": 2, "bf16": True}),
    ("tests/data/configs/bart-large.json", "float32", {"per_device_train_batch_size": 2}),
    ("tests/data/configs/bart-large.json", "float32", {"per_device_train_batch_size": 2, "bf16": True,
                                                        "gradient_checkpointing": True}),
]
#: an encoder-decoder's labels per sample (--target-len)
TARGET = 64

RUN = r'''
import json, sys, tempfile, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, Trainer, TrainingArguments, TrainerCallback
from memplan.harness.measure import follow_all_threads, live_totals
follow_all_threads()
cfg_dir, args, seq, target = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(cfg_dir)
cfg._attn_implementation = "sdpa"
seq2seq = bool(getattr(cfg, "is_encoder_decoder", False))
class DS(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i):
        x = torch.randint(0, cfg.vocab_size, (seq,))
        if seq2seq:  # the decoder's labels: the model shifts them into its inputs
            return {"input_ids": x, "labels": torch.randint(0, cfg.vocab_size, (target,))}
        return {"input_ids": x, "labels": x.clone()}
ta = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=3, use_cpu=True, report_to=[], save_strategy="no",
                       logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **args)
class Mark(TrainerCallback):
    def on_step_begin(self, a, s, c, **k):
        self.rf = torch.profiler.record_function(f"trainer-step-{s.global_step}"); self.rf.__enter__()
    def on_step_end(self, a, s, c, **k):
        self.rf.__exit__(None, None, None)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
    model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_config(cfg)
    Trainer(model=model, args=ta, train_dataset=DS(), callbacks=[Mark()]).train()
path = tempfile.mktemp(suffix=".json")
prof.export_chrome_trace(path)
ev = json.load(open(path))["traceEvents"]
tot = live_totals(ev, global_totals=True)
a, b = max((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X"
           and str(e.get("name", "")).startswith("trainer-step-"))
print(json.dumps({"peak": max(v for t, v in tot if a <= t <= b), "dtype": str(next(model.parameters()).dtype),
                  "optim": str(ta.optim)}))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-isa", default=None, help="default: this machine's (kernels.host_cpu_isa)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "accuracy-trainer.md"))
    args = ap.parse_args()
    from memplan.activations.kernels import host_cpu_isa

    args.cpu_isa = args.cpu_isa or host_cpu_isa()
    import torch
    import transformers

    from memplan.model import sources, tasks
    from memplan.model.scaling import scale_config

    rows = []
    for preset, dtype, ta in CASES:
        source = sources.resolve(str(ROOT / preset) if preset.endswith(".json") else preset)
        cfg, _ = scale_config(dict(source.config), layers=2, hidden=256, vocab=2048)
        seq2seq = tasks.task_of(cfg) == tasks.SEQ2SEQ
        cfg.pop("dtype", None)
        cfg["torch_dtype"] = dtype
        d = Path(tempfile.mkdtemp(prefix="memplan-trainer-"))
        (d / "config.json").write_text(json.dumps(cfg))
        (d / "ta.json").write_text(json.dumps(ta))
        run = subprocess.run([sys.executable, "-c", RUN, str(d), json.dumps(ta), str(SEQ), str(TARGET)],
                             capture_output=True, text=True, cwd=ROOT)
        if run.returncode:
            raise SystemExit(f"{preset} {ta}: the Trainer failed: {run.stderr[-1500:]}")
        measured = json.loads(run.stdout.strip().splitlines()[-1])
        est = subprocess.run([sys.executable, "-m", "memplan", "estimate", str(d), "--training-args", str(d / "ta.json"),
                              "--seq-len", str(SEQ), "--device", "cpu", "--cpu-isa", args.cpu_isa, "--json",
                              *(["--target-len", str(TARGET)] if seq2seq else [])],
                             capture_output=True, text=True, cwd=ROOT)
        if est.returncode not in (0, 1):
            raise SystemExit(f"{preset} {ta}: memplan failed: {est.stderr[-1500:]}")
        rep = json.loads(est.stdout)
        pred = rep["per_gpu"]["peak_bytes"]
        err = (pred - measured["peak"]) / measured["peak"]
        name = Path(preset).stem + (f" ({SEQ} in, {TARGET} out)" if seq2seq else "")
        rows.append((name, dtype, json.dumps(ta), rep["strategy"]["precision"], pred, measured["peak"], err))
        print(f"{preset} {dtype} {ta}: {rep['strategy']['precision']} predicted {pred:,} measured "
              f"{measured['peak']:,} {err:+.2%}", flush=True)
    lines = ["# The HF Trainer itself on CPU against memplan", "",
             f"Produced by `python bench/trainer_cpu.py --cpu-isa {args.cpu_isa}`: torch {torch.__version__}, "
             f"transformers {transformers.__version__}, one process on CPU. Each model scaled to 2 blocks (an encoder-decoder: 2 in each stack, "
             f"{TARGET} labels per sample, AutoModelForSeq2SeqLM), hidden "
             f"256, vocabulary 2048, its config's dtype set as shown (transformers 5 loads the model in it); "
             f"Trainer.train() for 3 steps of micro-batch 2 x sequence {SEQ} (the Trainer's defaults otherwise: "
             "adamw_torch_fused, max_grad_norm 1.0, zero_grad(set_to_none)); measured = the CPU allocator's "
             "most live bytes in the last step (torch.profiler memory events); predicted = `memplan estimate "
             "<config dir> --training-args ta.json --device cpu`, the recipe it picks shown. Error = (predicted - "
             "measured) / measured.", "",
             "| preset | config dtype | TrainingArguments | memplan recipe | predicted | measured | error |",
             "|---|---|---|---|---:|---:|---:|"]
    for p, dt, ta, rc, pred, meas, err in rows:
        lines.append(f"| {p} | {dt} | `{ta}` | {rc} | {pred:,} | {meas:,} | {err:+.2%} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
