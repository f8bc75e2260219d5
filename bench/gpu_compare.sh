#!/usr/bin/env bash
# End-to-end decode beside its baselines in one run: `compiled bench latency` (dummy weights, input
# 512, 16 output tokens) compiled + CUDA graphs with `--compare hf` (HF transformers on the same
# workload), then the eager engine (--enforce-eager), on the Qwen3-30B-A3B shape at batch 1, 8, 64
# and the Qwen3-0.6B shape at batch 1; then a 2,048-token prefill (time to first token, batch 1) the
# same three ways. JSON and text in ${OUT:-out}/; MODELS and PREFILL_MODELS override the lists (set
# to an empty string: none).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
both_ways() {  # name, tag, options: compiled with --compare hf, then --enforce-eager
  local name=$1 tag=$2; shift 2
  python -m cli.main bench latency "bench/configs/$name" "$@" --compare hf \
    --json "$out/${name}_${tag}_compiled.json" > "$out/${name}_${tag}_compiled.txt" 2>&1
  python -m cli.main bench latency "bench/configs/$name" "$@" --enforce-eager \
    --json "$out/${name}_${tag}_eager.json" > "$out/${name}_${tag}_eager.txt" 2>&1
  echo "== $name $tag"; grep -iE "decode|step|first token|error" "$out/${name}_${tag}_compiled.txt" | head -8
  grep -iE "decode|step|first token|error" "$out/${name}_${tag}_eager.txt" | head -4
}
common="--load-format dummy --max-model-len 2048 --max-num-seqs 64 --input-len 512 --output-len 16"
for entry in ${MODELS-qwen3-30b-a3b:1,8,64 qwen3-0.6b:1}; do
  name=${entry%%:*}
  for b in $(echo "${entry#*:}" | tr , ' '); do
    both_ways "$name" "b$b" $common --batch-size "$b"
  done
done
for name in ${PREFILL_MODELS-qwen3-30b-a3b}; do
  both_ways "$name" prefill2048 --load-format dummy --max-model-len 4096 --max-num-seqs 1 --input-len 2048 \
    --output-len 2 --batch-size 1
done
# The device tool returns at most 8 files: everything again in one archive (sorted first).
tar -C "$out" -czf "$out/0_all_results.tgz" --exclude 0_all_results.tgz .
