#!/bin/bash
# Session 23, device call 4: the two settings the session's fixes predict the other way, each checked once:
# llama-3-8b-4l FSDP2 with a bare fully_shard(model) (ROOT_AUTO=1; memplan --fsdp-root-reshard auto predicts
# 60,886,614,016 B reserved) and qwen2.5-7b-4l ZeRO-3 mb1 with memory_efficient_linear false (aten's linear:
# 46,070,235,136 B). Carrying .whl (prepared as run17.sh says): bash lab/gpu-runs/run23c.sh
# Out: $OUT/truth_check.jsonl ({"name", "r"}), $OUT/traces.tar.
cd "$(dirname "$0")/../../.whl" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ./*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/tr
run() {  # name, env, args...
  local name=$1 env=$2; shift 2
  line=$(env $env SNAPSHOT=full:/tmp/tr/$name.jsonl.gz timeout 100 python3 case.py "$@" 2>/tmp/e_$name | grep '^RESULT ' | tail -1)
  [ -n "$line" ] || { line='RESULT {"error": "no result"}'; tail -3 /tmp/e_$name; }
  echo "{\"name\": \"$name\", \"r\": ${line#RESULT }}" >> $OUT/truth_check.jsonl
  echo "$name $(echo $line | grep -o '"reserved_peak_bytes": [0-9]*')"
}
run l8b_fsdp_rootauto "ROOT_AUTO=1 PORT=29951" conf/llama-3-8b-4l.json fsdp2 full 2 4096 none sdpa &
run q7_z3mb1_aten "PORT=29952" conf/qwen2.5-7b-4l.json deepspeed '{"stage": 3, "memory_efficient_linear": false}' 1 512 none sdpa &
wait
tar cf $OUT/traces.tar -C /tmp/tr .
