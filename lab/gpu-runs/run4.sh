#!/bin/bash
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false MEMPLAN_CACHE_DIR=/tmp/mpcache
python3 .gpu/probe4.py 2>&1 | tail -2
t0=$(date +%s)
run() { name=$1; shift; now=$(date +%s); [ $((now - t0)) -gt 380 ] && { echo "skip $name"; return; }
  timeout 150 python3 -m memplan validate "$@" --device cuda --gpus 1 --json > $OUT/validate_$name.json 2>/tmp/verr_$name.txt
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(python3 -c "import json,sys; d=json.load(open('$OUT/validate_$name.json')); print(d['validation']['peak'], d['validation']['within_tolerance'])" 2>&1 | tail -1)"
  tail -3 /tmp/verr_$name.txt; }
run falcon bench/gpu/configs/falcon-7b-4l.json --strategy ddp --precision torch-amp --micro-batch 1 --seq-len 2048
run phi2 bench/gpu/configs/phi-2-6l.json --strategy ddp --precision torch-amp --micro-batch 2 --seq-len 1024
run qwen3z2 bench/gpu/configs/qwen3-0.6b.json --stage 2 --micro-batch 2 --seq-len 2048
run gemma3fsdp bench/gpu/configs/gemma3-1b.json --strategy fsdp-full --micro-batch 2 --seq-len 1024
run olmoe3 bench/gpu/configs/olmoe-2l.json --stage 3 --micro-batch 2 --seq-len 2048 --recompute full
ls -la $OUT
