#!/bin/bash
# Session 23, device call 3: the capacity and context figures of this GPU (../shared/gpu/context.py), then cases
# measured as a training loop runs them (case.py with NOSYNC=1: no synchronize between steps), one after another.
#   bash lab/gpu-runs/run23n.sh lab/gpu-runs/cases23n.tsv 200      (carrying .whl, prepared as run17.sh says)
# Out: $OUT/context.json, $OUT/truth_nosync.jsonl ({"name", "r": case.py's line}).
tsv=$(realpath "$1"); budget=${2:-200}
cd "$(dirname "$0")/../../.whl" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ./*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 context.py | grep '^RESULT ' | sed 's/^RESULT //' > $OUT/context.json; cat $OUT/context.json
t0=$(date +%s); i=0
while IFS=$'\t' read -r name model fw mode mb seq rc attn; do
  i=$((i+1)); [ $(( $(date +%s) - t0 )) -gt "$budget" ] && { echo "skip $name"; continue; }
  line=$(NOSYNC=1 PORT=$((29900+i)) timeout 120 python3 case.py "conf/$model.json" "$fw" "$mode" "$mb" "$seq" "$rc" "$attn" 2>/tmp/e_$name | grep '^RESULT ' | tail -1)
  [ -n "$line" ] || { line="RESULT {\"config\": \"$model.json\", \"error\": \"no result\"}"; tail -3 /tmp/e_$name; }
  echo "{\"name\": \"$name\", \"r\": ${line#RESULT }}" >> $OUT/truth_nosync.jsonl
  echo "$name $(( $(date +%s) - t0 ))s $(echo $line | grep -o '"reserved_peak_bytes": [0-9]*')"
done < "$tsv"
