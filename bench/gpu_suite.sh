#!/usr/bin/env bash
# One GPU run: the GPU tests, then the benchmarks; full results go to ${OUT:-out}/.
# Usage (repo root, on a CUDA machine): bash bench/gpu_suite.sh
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python -m pytest -m gpu -q -s ${GPU_TESTS:-tests} 2>&1 | tee "$out/gpu_tests.txt" | tail -40
for model in ${BENCH_MODELS:-bench/configs/qwen3-30b-a3b}; do
  name=$(basename "$model")
  for b in ${BATCHES:-1 8 64}; do
    python -m cli.main bench latency "$model" --load-format dummy --batch-size "$b" --input-len 512 \
      --output-len 32 --max-model-len 4096 --max-num-seqs 64 ${BENCH_FLAGS:-} \
      --json "$out/latency_${name}_b$b.json" 2>&1 | tee "$out/latency_${name}_b$b.txt" | tail -20
  done
done
echo "== summary =="
grep -E "passed|failed|error" "$out/gpu_tests.txt" | tail -3
grep -h "decode step median" "$out"/latency_*.txt
