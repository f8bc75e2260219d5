#!/usr/bin/env bash
# The feature figures on one GPU, in one go: the GPU tests of FP8, structured outputs and the
# tensor-parallel graph at a world of one; then, on the Qwen3-30B-A3B shape (dummy weights),
# bench/e2e_suite.py with bf16 and with FP8 weights (quantized at load) beside each other (decode
# at batch 1, 8, 64 and the 2,048-token prefill), and `compiled bench latency` at batch 64 without
# and with a JSON schema on every row; with FP8 weights, bench/lora_bench.py at batch 64 (8
# rank-16 adapters on every target, then the base) and the serving workload of
# bench/serving_suite.sh (random 2,048 in / 1,024 out at concurrency 10). Results in ${OUT:-out}/.
# Not by default, `lintune`: the FP8 linears' tile sweep (bench/linear_bench.py --fp8: GEMV mode at
# one row, skinny tiles at 8, the W8A16 GEMM at 32 to 256 on the 30B's qkv and o_proj, cuBLAS's
# W8A8 beside it; 12 x LINTUNE_BUDGET_S of sweeping plus start-up, within STEP_TIMEOUT), the best
# per shape and M beside the heuristic's pick in $OUT/linear_fp8.json (written after each, so a
# timeout keeps the rest).
#   PARTS (default "tests structured fp8 lora serving"): which to run, in that order; STEP_TIMEOUT (s, default 240);
#   QUANTS (default "fp8 bf16"): the e2e runs (each with its decode and prefill profiles);
#   LINTUNE_BUDGET_S (default 18): lintune's sweep time per shape and row count (12 of them).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
model=${MODEL:-bench/configs/qwen3-30b-a3b}
limit=${STEP_TIMEOUT:-240}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
tests() {
  timeout "$limit" python -m pytest -m gpu -q -x ${GPU_TESTS:-tests/quant tests/structured \
    tests/runtime/test_structured_generate.py tests/parallel/test_tp_world_of_one.py} > "$out/gpu_tests.txt" 2>&1
  echo "== gpu tests (exit $?)"; tail -15 "$out/gpu_tests.txt"
}
structured() {
  for kind in none json; do
    flags=(); [ "$kind" = json ] && flags=(--structured json)
    timeout "$limit" python -m cli.main bench latency "$model" --load-format dummy --batch-size 64 --input-len 512 \
      --output-len 64 --num-iters 3 --num-iters-warmup 1 "${flags[@]}" --json "$out/structured_$kind.json" \
      > "$out/structured_$kind.txt" 2>&1
    echo "== structured $kind (exit $?)"
    grep -E "decode step|structured|grammar|mask|rror" "$out/structured_$kind.txt"
  done
}
fp8() {
  for q in ${QUANTS:-fp8 bf16}; do
    flags=(--profile-dir "$(mktemp -d)"); [ "$q" = fp8 ] && flags+=(--quantization fp8)
    timeout "$limit" python bench/e2e_suite.py "$model" --out "$out/e2e_$q.json" "${flags[@]}" > "$out/e2e_$q.txt" 2>&1
    echo "== e2e $q (exit $?)"; grep -E "^batch|^prefill|rror" "$out/e2e_$q.txt"
  done
}
lora() {
  for side in lora base; do
    flags=(--num-loras 8 --rank 16 --skip-idle); [ "$side" = base ] && flags=(--base)
    timeout "$limit" python bench/lora_bench.py "$model" --quantization fp8 --batches 64 --prefill-reps 3 \
      --profile-batches "" "${flags[@]}" --out "$out/lora_fp8_$side.json" > "$out/lora_fp8_$side.txt" 2>&1
    echo "== lora fp8 $side (exit $?)"; grep -E "batch 64|prefill|rror" "$out/lora_fp8_$side.txt"
  done
}
lintune() {
  timeout "$limit" python bench/linear_bench.py --fp8 --budget-s "${LINTUNE_BUDGET_S:-18}" \
    --out "$out/linear_fp8.json" > "$out/linear_fp8.txt" 2>&1
  echo "== lintune (exit $?)"; grep -E "^  fp8 |^\||rror" "$out/linear_fp8.txt"
}
serving() {
  OUT=$out/serving PARTS=random ENGINE_FLAGS="--quantization fp8" timeout $((2 * limit)) bash bench/serving_suite.sh
}
for part in ${PARTS:-tests structured fp8 lora serving}; do "$part"; done
