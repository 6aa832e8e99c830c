#!/bin/bash
# usage: go.sh CASES_TSV BUDGET_S  (run from repo root on the device)
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ./*.whl && export PYTHONPATH=/tmp/site || exit 1
python3 -c "import transformers, deepspeed; print(transformers.__version__, deepspeed.__version__)" 2>&1 | tail -1 || true
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/tr; t0=$(date +%s); i=0
while IFS=$'\t' read -r name model fw mode mb seq rc attn; do
  i=$((i+1)); now=$(date +%s); [ $((now - t0)) -gt $2 ] && { echo "skip $i $name"; continue; }
  line=$(SNAPSHOT=full:/tmp/tr/$name.jsonl.gz PORT=$((29700+i)) timeout 120 python3 case.py "conf/$model.json" "$fw" "$mode" "$mb" "$seq" "$rc" "$attn" 2>/tmp/e$i | grep '^RESULT ' | tail -1)
  [ -n "$line" ] || { line="RESULT {\"config\": \"$model.json\", \"error\": \"no result\"}"; tail -3 /tmp/e$i; }
  echo "{\"name\": \"$name\", \"r\": ${line#RESULT }}" >> $OUT/truth_new.jsonl; echo "$i $(( $(date +%s) - t0 ))s $(echo $line | cut -c1-300)"
done < "$1"
tar cf $OUT/traces.tar -C /tmp/tr . ; ls -la /tmp/tr
