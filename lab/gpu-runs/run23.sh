#!/bin/bash
# Session 23's runner: run17.sh's cases in two lanes at once on one GPU (each process has its own caching
# allocator, so one run's figures do not depend on the other's; the H200's 139 GiB holds any two cases of
# cases23.tsv: lane A takes every case predicted above 46 GB reserved, the largest first, lane B the rest,
# smallest first). An optional 9th column is the run's PYTORCH_CUDA_ALLOC_CONF.
# Prepare here as run17.sh says (.whl with the wheels, .whl/conf, .whl/case.py); on the device, carrying .whl:
#   bash lab/gpu-runs/run23.sh bench/gpu/cases23.tsv bench/gpu/blind-session23.json 330
# Out: $OUT/truth_new.jsonl ({"name", "alloc_conf", "r": case.py's line}), $OUT/traces.tar, $OUT/lanes.log.
tsv=$(realpath "$1"); blind=$(realpath "$2"); budget=${3:-330}
cd "$(dirname "$0")/../../.whl" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ./*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 - "$tsv" "$blind" <<'PY'
import json, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines() if l.strip()]
pred = json.load(open(sys.argv[2]))["predictions"]
big = sorted((r for r in rows if pred[r[0]]["reserved"] > 46e9), key=lambda r: -pred[r[0]]["reserved"])
small = sorted((r for r in rows if pred[r[0]]["reserved"] <= 46e9), key=lambda r: pred[r[0]]["reserved"])
a, b = big, small
while len(a) < len(b):  # the largest of the small cases go to lane A, after its big ones
    a.append(b.pop())
open("/tmp/laneA", "w").write("".join("\t".join(r) + "\n" for r in a))
open("/tmp/laneB", "w").write("".join("\t".join(r) + "\n" for r in b))
print("lane A:", [r[0] for r in a]); print("lane B:", [r[0] for r in b])
PY
mkdir -p /tmp/tr; t0=$(date +%s)
lane() {  # $1 lane file, $2 port base
  local i=0
  while IFS=$'\t' read -r name model fw mode mb seq rc attn conf; do
    i=$((i+1)); [ $(( $(date +%s) - t0 )) -gt "$budget" ] && { echo "skip $name"; continue; }
    line=$(env ${conf:+PYTORCH_CUDA_ALLOC_CONF=$conf} SNAPSHOT=full:/tmp/tr/$name.jsonl.gz PORT=$(($2+i)) timeout 150 python3 case.py "conf/$model.json" "$fw" "$mode" "$mb" "$seq" "$rc" "$attn" 2>/tmp/e_$name | grep '^RESULT ' | tail -1)
    [ -n "$line" ] || { line="RESULT {\"config\": \"$model.json\", \"error\": \"no result\"}"; tail -3 /tmp/e_$name; }
    echo "{\"name\": \"$name\", \"alloc_conf\": \"$conf\", \"r\": ${line#RESULT }}" >> $OUT/truth_new.jsonl
    echo "$name $(( $(date +%s) - t0 ))s $(echo $line | cut -c1-200)"
  done < "$1"
}
lane /tmp/laneA 29700 > $OUT/laneA.log 2>&1 &
lane /tmp/laneB 29800 > $OUT/laneB.log 2>&1 &
wait
cat $OUT/laneA.log $OUT/laneB.log
tar cf $OUT/traces.tar -C /tmp/tr . ; ls -la /tmp/tr | tail -30
