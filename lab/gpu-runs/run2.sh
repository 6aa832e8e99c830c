#!/bin/bash
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1
for isa in DEFAULT AVX512_CORE_AMX AVX512_CORE_BF16 AVX512_CORE AVX2; do
  ( if [ $isa = DEFAULT ]; then unset ONEDNN_MAX_CPU_ISA; else export ONEDNN_MAX_CPU_ISA=$isa; fi
    THREADS=3 timeout 300 python3 gemm_isa.py 2>/dev/null | tail -1 > /tmp/gemm_$isa.json ) &
done
timeout 400 python3 probe2.py 2>&1 | grep -v Warning | tail -5
wait
cat /tmp/gemm_*.json > $OUT/gemm_isa.jsonl
lscpu | grep -E "Model name|^CPU\(s\)" >> $OUT/gemm_isa.jsonl
ls -la $OUT
