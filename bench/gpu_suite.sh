#!/usr/bin/env bash
# One GPU run: the GPU tests, then the benchmarks; full results go to ${OUT:-out}/.
# Usage (repo root, on a CUDA machine): bash bench/gpu_suite.sh
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/device.txt"
python -m pytest -m gpu -q -s ${GPU_TESTS:-tests} 2>&1 | tee "$out/gpu_tests.txt" | tail -40
for model in ${BENCH_MODELS:-bench/configs/qwen3-30b-a3b}; do
  name=$(basename "$model")
  python bench/eager_baseline.py --model "$model" --hf --out "$out/eager_$name.json" 2>&1 | tee "$out/eager_$name.txt" | tail -8
done
echo "== summary =="
grep -E "passed|failed|error" "$out/gpu_tests.txt" | tail -3
cat "$out"/eager_*.txt | grep -A5 "context"
