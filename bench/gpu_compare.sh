#!/usr/bin/env bash
# End-to-end decode beside its baselines in one run: `compiled bench latency` (dummy weights, input
# 512, 16 output tokens) compiled + CUDA graphs with `--compare hf` (HF transformers on the same
# workload), then the eager engine (--enforce-eager), on the Qwen3-30B-A3B shape at batch 1, 8, 64
# and the Qwen3-0.6B shape at batch 1. JSON and text in ${OUT:-out}/; MODELS overrides the list.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
common="--load-format dummy --max-model-len 2048 --max-num-seqs 64 --input-len 512 --output-len 16"
for entry in ${MODELS:-qwen3-30b-a3b:1,8,64 qwen3-0.6b:1}; do
  name=${entry%%:*}
  for b in $(echo "${entry#*:}" | tr , ' '); do
    python -m cli.main bench latency "bench/configs/$name" $common --batch-size "$b" --compare hf \
      --json "$out/${name}_b${b}_compiled.json" > "$out/${name}_b${b}_compiled.txt" 2>&1
    python -m cli.main bench latency "bench/configs/$name" $common --batch-size "$b" --enforce-eager \
      --json "$out/${name}_b${b}_eager.json" > "$out/${name}_b${b}_eager.txt" 2>&1
    echo "== $name batch $b"; grep -iE "decode|step|hf|error" "$out/${name}_b${b}_compiled.txt" | head -8
    grep -iE "decode|step|error" "$out/${name}_b${b}_eager.txt" | head -4
  done
done
