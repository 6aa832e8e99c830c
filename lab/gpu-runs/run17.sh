#!/bin/bash
# Session 17's runner: each case of a cases file measured with case.py and its allocator event stream recorded.
# Prepare here (see /work/.library/device/README.md): wheels in .whl (DS_BUILD_OPS=0 pip wheel deepspeed==0.19.8,
# hjson, pydantic, pydantic-core cp312, annotated-types, typing-inspection, typing-extensions>=4.16,
# transformers==5.23.0, tokenizers, huggingface-hub), the configs in .whl/conf (../shared/gpu/configs and
# bench/gpu/configs), and lab/gpu-runs/case.py copied to .whl/case.py; then on the device, carrying .whl:
#   bash lab/gpu-runs/run17.sh lab/gpu-runs/cases17.tsv 470
# Out: $OUT/truth_new.jsonl ({"name", "r": case.py's line}) and $OUT/traces.tar (one [action, address, size,
# stream] stream per case, SNAPSHOT=full).
tsv=$(realpath "$1"); budget=${2:-470}
cd "$(dirname "$0")/../../.whl" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ./*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/tr; t0=$(date +%s); i=0
while IFS=$'\t' read -r name model fw mode mb seq rc attn; do
  i=$((i+1)); now=$(date +%s); [ $((now - t0)) -gt "$budget" ] && { echo "skip $i $name"; continue; }
  line=$(SNAPSHOT=full:/tmp/tr/$name.jsonl.gz PORT=$((29700+i)) timeout 120 python3 case.py "conf/$model.json" "$fw" "$mode" "$mb" "$seq" "$rc" "$attn" 2>/tmp/e$i | grep '^RESULT ' | tail -1)
  [ -n "$line" ] || { line="RESULT {\"config\": \"$model.json\", \"error\": \"no result\"}"; tail -3 /tmp/e$i; }
  echo "{\"name\": \"$name\", \"r\": ${line#RESULT }}" >> $OUT/truth_new.jsonl; echo "$i $(( $(date +%s) - t0 ))s $(echo $line | cut -c1-300)"
done < "$tsv"
tar cf $OUT/traces.tar -C /tmp/tr . ; ls -la /tmp/tr
