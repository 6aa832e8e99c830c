"""Predict a device cases file before it is measured (a blind check), and compare those predictions afterwards.

    python bench/gpu_blind.py predict bench/gpu/cases23.tsv bench/gpu/blind-session23.json
    python bench/gpu_blind.py compare bench/gpu/blind-session23.json TRUTH_NEW.jsonl
    python bench/gpu_blind.py compare bench/gpu/blind-session23.json bench/gpu/truth-extra.jsonl

A cases file is run17.sh's: one case a line, tab-separated name, model (a config in ../shared/gpu/configs or
bench/gpu/configs), framework, mode, micro-batch, sequence length, recompute, attention, and optionally the
run's PYTORCH_CUDA_ALLOC_CONF. `predict` writes, per name,
memplan's allocated peak, reserved peak, how the reserved peak was found and the fit verdict's required bytes, as
bench/gpu_accuracy.py predicts a measured case. `compare` reads the run's output (run17.sh's truth_new.jsonl: one
{"name", "r": gpu_case.py's result} a line) and prints the blind and the current prediction against each
measured figure (truth-extra.jsonl's lines name their case at the end of "source").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_accuracy import EXTRA, predict  # noqa: E402

CONFIG_DIRS = [ROOT.parent / "shared" / "gpu" / "configs", EXTRA / "configs"]


def read_cases(path: Path) -> dict[str, dict]:
    cases = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        name, model, fw, mode, mb, seq, rc, attn, *conf = line.split("\t")
        cases[name] = {"config": f"{model}.json", "framework": fw, "mode": mode, "micro_batch": int(mb),
                       "seq_len": int(seq), "recompute": rc, "attn": attn, "alloc_conf": conf[0] if conf else ""}
    return cases


def one(case: dict) -> dict:
    p = predict(case, CONFIG_DIRS)
    return {"peak": p["peak_bytes"], "reserved": p["reserved_peak_bytes"], "method": p["reserved_method"],
            "variants": p["reserved_variants"], "required": p["required_bytes"]}


def pct(a: int, b: int) -> str:
    return f"{(a - b) / b * 100:+.2f}%"


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("predict")
    p.add_argument("cases")
    p.add_argument("out")
    c = sub.add_parser("compare")
    c.add_argument("blind")
    c.add_argument("truth")
    c.add_argument("--cases", default=None, help="the cases file (default: the blind file's own)")
    a = ap.parse_args()
    if a.cmd == "predict":
        cases = read_cases(Path(a.cases))
        out = {"cases_file": str(Path(a.cases).resolve().relative_to(ROOT)), "predictions": {}}
        for name, case in cases.items():
            out["predictions"][name] = one(case)
            r = out["predictions"][name]
            print(f"{name:14s} peak {r['peak']:>15,} reserved {r['reserved']:>15,} ({r['method']})", flush=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        return
    blind = json.loads(Path(a.blind).read_text())
    preds = blind.get("predictions", blind)
    cases = read_cases(ROOT / (a.cases or blind["cases_file"]))
    print("| case | measured peak | blind | now | measured reserved | blind | now |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for line in Path(a.truth).read_text().splitlines():
        rec = json.loads(line)
        if "name" in rec:
            name, r = rec["name"], rec["r"]
        else:  # a bench/gpu/truth-extra.jsonl line: its source ends with ", case NAME"
            name, r = rec.get("source", "").rpartition(", case ")[2], rec
        if name not in cases:
            continue
        if "peak_bytes" not in r:
            print(f"| {name} | {r.get('error', 'no result')} | | | | | |")
            continue
        b, now = preds.get(name), one(cases[name])
        mp, mr = r["peak_bytes"], r["reserved_peak_bytes"]
        print(f"| {name} | {mp:,} | {pct(b['peak'], mp) if b else '-'} | {pct(now['peak'], mp)} | {mr:,} | "
              f"{pct(b['reserved'], mr) if b else '-'} | {pct(now['reserved'], mr)} |")


if __name__ == "__main__":
    main()
