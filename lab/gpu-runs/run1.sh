#!/bin/bash
# device call 1: probe + new truth cases
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
lscpu | grep -E "Model name|Flags" > $OUT/host_cpu.txt; nproc >> $OUT/host_cpu.txt
python3 -c "import transformers, torch; print(transformers.__version__, torch.__version__)"
(for t in 2 1; do python3 gemm_grid.py $t; done) > $OUT/host_gemm.txt 2>&1 &
(timeout 420 python3 probe.py > $OUT/probe_log.txt 2>&1) &
i=0
while IFS=$'\t' read -r model fw mode mb seq rc attn; do
  i=$((i+1)); port=$((29600 + i))
  snap=summary
  [ $i = 1 ] && snap="full:$OUT/trace_qwen3_fp32.jsonl.gz"
  [ $i = 5 ] && snap="full:$OUT/trace_phi3_fsdp.jsonl.gz"
  line=$(SNAPSHOT=$snap PORT=$port timeout 100 python3 case.py "configs/$model.json" "$fw" "$mode" "$mb" "$seq" "$rc" "$attn" 2>$OUT/err_$i.txt | grep '^RESULT ' | tail -1)
  [ -n "$line" ] || line="RESULT {\"config\": \"$model.json\", \"framework\": \"$fw\", \"error\": \"no result\"}"
  echo "${line#RESULT }" >> $OUT/new_truth.jsonl
  echo "$i $model $fw $mode: $(echo "$line" | cut -c1-150)"
  case "$line" in *'"error"'*) ;; *) rm -f $OUT/err_$i.txt;; esac
done < cases.tsv
# expandable segments variants for two cases
for c in "qwen3-0.6b ddp amp 4 2048 none sdpa" "phi3-mini-4l fsdp2 full 4 2048 none sdpa"; do
  set -- $c
  line=$(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PORT=29700 timeout 100 python3 case.py "configs/$1.json" $2 $3 $4 $5 $6 $7 2>/dev/null | grep '^RESULT ' | tail -1)
  echo "${line#RESULT }" | sed 's/^{/{"alloc_conf": "expandable_segments:True", /' >> $OUT/new_truth.jsonl
  echo "exp $1 $2: $(echo "$line" | cut -c1-120)"
done
wait
(tail -3 $OUT/probe_log.txt; cat $OUT/err_*.txt 2>/dev/null | tail -60) > $OUT/errors.txt; rm -f $OUT/err_*.txt $OUT/probe_log.txt
ls -la $OUT
