#!/bin/bash
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
i=0; t0=$(date +%s)
while IFS=$'\t' read -r model fw mode mb seq rc attn; do
  i=$((i+1)); port=$((29600 + i))
  now=$(date +%s); [ $((now - t0)) -gt 470 ] && { echo "time up before case $i"; break; }
  snap=summary
  [ $i = 1 ] && snap="full:$OUT/trace_phi2_ddp_amp.jsonl.gz"
  [ $i = 17 ] && snap="full:$OUT/trace_olmo2_fsdp_gradop_rc.jsonl.gz"
  line=$(SNAPSHOT=$snap PORT=$port timeout 90 python3 case.py "configs/$model.json" "$fw" "$mode" "$mb" "$seq" "$rc" "$attn" 2>/tmp/err_$i.txt | grep '^RESULT ' | tail -1)
  [ -n "$line" ] || line="RESULT {\"config\": \"$model.json\", \"framework\": \"$fw\", \"mode\": \"$mode\", \"error\": \"no result\"}"
  echo "${line#RESULT }" >> $OUT/truth3.jsonl
  echo "$i $model $fw $mode: $(echo "$line" | cut -c1-120) $(( $(date +%s) - t0 ))s"
  case "$line" in *'"error"'*) { echo "== $i $model $fw $mode"; tail -15 /tmp/err_$i.txt; } >> $OUT/errors3.txt;; esac
done < cases3.tsv
now=$(date +%s)
if [ $((now - t0)) -lt 500 ]; then
  line=$(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PORT=29700 timeout 60 python3 case.py configs/phi-2-6l.json ddp amp 4 2048 none sdpa 2>/dev/null | grep '^RESULT ' | tail -1)
  echo "${line#RESULT }" | sed 's/^{/{"alloc_conf": "expandable_segments:True", /' >> $OUT/truth3.jsonl
fi
ls -la $OUT
