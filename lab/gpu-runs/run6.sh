#!/bin/bash
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false MEMPLAN_CACHE_DIR=/tmp/mpcache
t0=$(date +%s)
run() { name=$1; shift; now=$(date +%s); [ $((now - t0)) -gt 300 ] && { echo "skip $name"; return; }
  timeout 150 python3 -m memplan validate "$@" --device cuda --gpus 1 --json > $OUT/validate_$name.json 2>/tmp/verr_$name.txt
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(python3 -c "import json,sys; d=json.load(open('$OUT/validate_$name.json')); print(d['validation']['peak'])" 2>&1 | tail -1)"
  tail -2 /tmp/verr_$name.txt; }
run smollm2fp32 bench/gpu/configs/smollm2-135m.json --strategy ddp --precision fp32 --micro-batch 2 --seq-len 2048
run falcon2 bench/gpu/configs/falcon-7b-4l.json --strategy ddp --precision torch-amp --micro-batch 2 --seq-len 2048
run qwen3fp32 bench/gpu/configs/qwen3-0.6b.json --strategy ddp --precision fp32 --micro-batch 2 --seq-len 1024
run mixtral1lz2 bench/gpu/configs/mixtral-8x7b-1l.json --stage 2 --micro-batch 2 --seq-len 2048
