#!/bin/bash
# Session 23, device call 5: the event streams of the two DDP runs whose replay, as they released their first
# buckets, is more than 3% under (olmoe-2l amp mb4 -4.06%, phi-2-6l fp32 mb2 -3.47%; docs/accuracy-gpu.md).
# Carrying .whl (prepared as run17.sh says): bash lab/gpu-runs/run23d.sh
# Out: $OUT/truth_ddp.jsonl ({"name", "r"}), $OUT/traces.tar.
cd "$(dirname "$0")/../../.whl" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ./*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/tr
run() {  # name, port, args...
  local name=$1 port=$2; shift 2
  line=$(PORT=$port SNAPSHOT=full:/tmp/tr/$name.jsonl.gz timeout 100 python3 case.py "$@" 2>/tmp/e_$name | grep '^RESULT ' | tail -1)
  [ -n "$line" ] || { line='RESULT {"error": "no result"}'; tail -3 /tmp/e_$name; }
  echo "{\"name\": \"$name\", \"r\": ${line#RESULT }}" >> $OUT/truth_ddp.jsonl
  echo "$name $(echo $line | grep -o '"reserved_peak_bytes": [0-9]*')"
}
run olmoe_ddp_amp 29961 conf/olmoe-2l.json ddp amp 4 2048 none sdpa &
run phi2_ddp_fp32 29962 conf/phi-2-6l.json ddp fp32 2 2048 none sdpa &
wait
tar cf $OUT/traces.tar -C /tmp/tr .
