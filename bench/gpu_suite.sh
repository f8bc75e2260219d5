#!/usr/bin/env bash
# GPU tests, then `compiled bench latency` per model and batch size (dummy weights, input 512);
# full results go to ${OUT:-out}/, a summary to the terminal.
# Usage (repo root, on a CUDA machine): bash bench/gpu_suite.sh
#   GPU_TESTS="tests/..." (pytest -m gpu; default tests, empty: none)
#   BENCH_MODELS="bench/configs/qwen3-30b-a3b bench/configs/qwen3-0.6b", BATCHES="1 8 64",
#   BENCH_FLAGS (more `bench latency` options)
#   COMPARE=1: each latency run with --compare hf (HF transformers on the same workload, same
#   process), then again with --enforce-eager (the engine uncompiled), and a 2,048-token prefill
#   (time to first token, batch 1) of each model the same ways. `bench latency` runs the batch 5
#   times untimed, then 10 times measured (its defaults); the eager engine 1 + 3 times (a decode
#   step of the 30B shape takes ~0.1-0.9 s eager).
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
tests=${GPU_TESTS-tests}
if [ -n "$tests" ]; then
  python -m pytest -m gpu -q -s $tests 2>&1 | tee "$out/gpu_tests.txt" | tail -40
fi
latency() {  # tag, model, options
  local tag=$1 model=$2; shift 2
  python -m cli.main bench latency "$model" --load-format dummy "$@" ${BENCH_FLAGS:-} \
    --json "$out/latency_$tag.json" > "$out/latency_$tag.txt" 2>&1
  tail -20 "$out/latency_$tag.txt"
}
eager_iters=(--num-iters-warmup 1 --num-iters 3)
for model in ${BENCH_MODELS:-bench/configs/qwen3-30b-a3b}; do
  name=$(basename "$model")
  common=(--input-len 512 --output-len 32 --max-model-len 4096 --max-num-seqs 64)
  for b in ${BATCHES:-1 8 64}; do
    if [ -n "${COMPARE:-}" ]; then
      latency "${name}_b$b" "$model" "${common[@]}" --batch-size "$b" --compare hf
      latency "${name}_b${b}_eager" "$model" "${common[@]}" --batch-size "$b" --enforce-eager "${eager_iters[@]}"
    else
      latency "${name}_b$b" "$model" "${common[@]}" --batch-size "$b"
    fi
  done
  if [ -n "${COMPARE:-}" ]; then
    prefill=(--input-len 2048 --output-len 2 --batch-size 1 --max-model-len 4096 --max-num-seqs 1)
    latency "${name}_prefill2048" "$model" "${prefill[@]}" --compare hf
    latency "${name}_prefill2048_eager" "$model" "${prefill[@]}" --enforce-eager "${eager_iters[@]}"
  fi
done
echo "== summary =="
[ -f "$out/gpu_tests.txt" ] && grep -E "passed|failed|error" "$out/gpu_tests.txt" | tail -3
grep -H -E "decode step median|time to first token" "$out"/latency_*.txt
