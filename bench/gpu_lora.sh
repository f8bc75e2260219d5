#!/usr/bin/env bash
# LoRA against the base engine on one machine: Qwen3-30B-A3B shape with no LoRA, with LoRA enabled
# but idle, and with 8 random rank-16 adapters on all targets (experts included) uniform over the
# batch (about 13 GB of adapters: an H200); then the Qwen3-0.6B shape with one adapter at batch 1.
# SERVING=1 adds `compiled bench serving` of the 30B shape with 32 adapters over 8 GPU slots at
# SERVING_RATE requests/s (default 4: the base serves it comfortably), zipf popularity beside every
# request on one adapter (median TTFT target: at most 2x); SERVING_ONLY=1 runs only that.
# Results in ${OUT:-out}/.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
run() {  # name model args...
  local name=$1 model=$2; shift 2
  python bench/lora_bench.py "bench/configs/$model" --out "$out/$name.json" "$@" > "$out/$name.txt" 2>&1
  grep -E "adapters|base|idle|Error|error|peak" "$out/$name.txt" | tail -20
}
if [ -z "${SERVING_ONLY:-}" ]; then
run 30b_base qwen3-30b-a3b --base
run 30b_lora qwen3-30b-a3b --num-loras "${NUM_LORAS:-8}" --rank 16
python bench/lora_compare.py "$out/30b_base.json" "$out/30b_lora.json" | tee "$out/30b_table.md"
run 06b_base qwen3-0.6b --base --batches 1
run 06b_lora qwen3-0.6b --num-loras 1 --rank 16 --batches 1
python bench/lora_compare.py "$out/06b_base.json" "$out/06b_lora.json" | tee "$out/06b_table.md"
fi
if [ -n "${SERVING:-}${SERVING_ONLY:-}" ]; then
  serving() {  # name dist
    python -m cli.main bench serving ${SERVING_MODEL-bench/configs/qwen3-30b-a3b} --load-format dummy \
      --num-loras 32 --lora-dist "$2" --max-loras-per-batch 8 --num-prompts "${SERVING_PROMPTS:-200}" \
      --input-len "${SERVING_INPUT:-512}" --output-len "${SERVING_OUTPUT:-128}" --request-rate "${SERVING_RATE:-4}" --json "$out/$1.json" > "$out/$1.txt" 2>&1
    echo "== $1"; grep -iE "output tokens/s|time to first|error" "$out/$1.txt"
  }
  serving serve_32_zipf zipf
  serving serve_32_one one
fi
