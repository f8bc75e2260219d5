#!/usr/bin/env bash
# Tune the fused MoE for FP8 experts on this GPU in one go: Qwen3-30B-A3B's expert shape (E=128,
# H=2048, I=768, top-8), dummy FP8 experts with 128 x 128 block scales. In order (PARTS):
#   before  bench/moe_bench.py --quantization fp8 at the tuned token counts, with the configs FP8
#           experts read before this script (the bf16 file's, GEMV_TILES)
#   tune    bench/tune_moe.py --quantization fp8 at TOKENS (W8A16 and W8A8 each, the faster written)
#   gemv    bench/moe_bench.py --quantization fp8 --only-gemv --write-gemv: the one-token GEMV tiles
#   after   moe_bench.py again, with the tuned file
#   tests   (not by default) the GPU tests of the FP8 MoE (tests/quant/test_fp8_kernel.py -k moe),
#           with the tuned file
# tune and gemv write into CONFIG_OUT (default compiled/moe/configs), the FP8 experts' file
# E=128,N=768,device_name=<this GPU>,dtype=fp8_w8a8.json (commit it; token counts not in TOKENS, or not
# reached within the budget, keep their entries); a copy and every log land in
# ${OUT:-out}/. The whole run keeps to the budget (seconds, default 450): each part gets a share
# (before 10%, gemv 18%, after 10%, tests 15%; tune the rest, 62% by default) as its
# time limit.
#   bash bench/gpu_fp8_tune.sh [--budget-s SECONDS]
#   PARTS (default "before tune gemv after"), TOKENS (default "1 8 64 256 512 2048").
set -uo pipefail
budget=450
while [ $# -gt 0 ]; do
  case "$1" in
    --budget-s) budget=$2; shift 2 ;;
    --budget-s=*) budget=${1#*=}; shift ;;
    *) echo "usage: bash bench/gpu_fp8_tune.sh [--budget-s SECONDS]" >&2; exit 2 ;;
  esac
done
out=${OUT:-out}; mkdir -p "$out"
cfg_out=${CONFIG_OUT:-compiled/moe/configs}
parts=${PARTS:-before tune gemv after}
tokens=${TOKENS:-1 8 64 256 512 2048}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
shape=(--E 128 --H 2048 --I 768 --topk 8)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"

declare -A share=([before]=10 [gemv]=18 [after]=10 [tests]=15)
tune_s=$budget
for part in $parts; do [ "$part" != tune ] && tune_s=$((tune_s - budget * ${share[$part]:-0} / 100)); done
limit() { [ "$1" = tune ] && echo "$tune_s" || echo $((budget * ${share[$1]} / 100)); }
bench() {   # moe_bench.py over FP8 experts at the tuned token counts (no HF baselines, no paired matmul)
  timeout "$(limit "$1")" python bench/moe_bench.py --quantization fp8 "${shape[@]}" --tokens $tokens --layers 8 \
    --reps 10 --paired-from 1000000 --out "$out/moe_fp8_$1.json" > "$out/moe_fp8_$1.txt" 2>&1
  echo "== moe_bench fp8 $1 (exit $?)"; grep -E "^\| |^  T=.*fused_us|rror" "$out/moe_fp8_$1.txt" | cut -c1-200
}
before() { bench before; }
after() { bench after; }
tune() {
  # thinned spaces after two thirds of its time; no token count started in its last 45 s (one may
  # run that long), the file rewritten after each: a run cut short by the timeout keeps those done
  local s=$tune_s
  timeout "$s" python bench/tune_moe.py --quantization fp8 "${shape[@]}" --tokens $tokens --out-dir "$cfg_out" \
    --budget-s $((s * 2 / 3)) --time-limit-s $((s - 45)) --merge > "$out/tune.txt" 2>&1
  echo "== tune fp8 (exit $?)"; grep -E "best|variants|compiled in|wrote|limit|Error" "$out/tune.txt"
}
gemv() {
  local s; s=$(limit gemv)
  timeout "$s" python bench/moe_bench.py --quantization fp8 "${shape[@]}" --only-gemv --write-gemv "$cfg_out" \
    --time-limit-s $((s - 30)) --out "$out/gemv_fp8.json" > "$out/gemv_fp8.txt" 2>&1
  echo "== gemv fp8 (exit $?)"; grep -E "gemv now|wrote|limit|rror" "$out/gemv_fp8.txt"; grep "gemv sweep" "$out/gemv_fp8.txt" | head -3
}
tests() {
  timeout "$(limit tests)" python -m pytest -m gpu -q -x tests/quant/test_fp8_kernel.py -k moe > "$out/tests.txt" 2>&1
  echo "== gpu fp8 moe tests (exit $?)"; tail -3 "$out/tests.txt"
}
for part in $parts; do "$part"; done
cp "$cfg_out"/*dtype=fp8_w8a8.json "$out/" 2>/dev/null && ls "$out"/*dtype=fp8_w8a8.json
tar -C "$out" -czf "$out/0_all_results.tgz" --exclude 0_all_results.tgz .
