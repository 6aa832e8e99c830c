#!/bin/bash
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
t0=$(date +%s); i=0
while IFS=$'\t' read -r model fw mode mb seq rc attn; do
  i=$((i+1)); now=$(date +%s); [ $((now - t0)) -gt 190 ] && { echo "skip $i $model"; continue; }
  line=$(PORT=$((29700+i)) timeout 60 python3 case.py "configs/$model.json" "$fw" "$mode" "$mb" "$seq" "$rc" "$attn" 2>/tmp/e$i | grep '^RESULT ' | tail -1)
  [ -n "$line" ] || { line="RESULT {\"config\": \"$model.json\", \"error\": \"no result\"}"; tail -3 /tmp/e$i; }
  echo "${line#RESULT }" >> $OUT/truth7.jsonl; echo "$i $(( $(date +%s) - t0 ))s $(echo $line | cut -c1-90)"
done < cases7.tsv
