#!/usr/bin/env bash
# A short GPU run: loader memory on the GPU, compiled+graphs vs uncompiled, then
# `compiled bench latency` / `throughput` on the Qwen3-30B-A3B shape with --compare hf.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
python -m pytest -m gpu -q -s tests/test_load_memory.py tests/test_gpu_compile.py 2>&1 | tee "$out/gpu_tests.txt" | grep -E "ratio|batch [0-9]+:|passed|failed|Error" | tail -20
m=bench/configs/qwen3-30b-a3b
python -m cli.main bench latency $m --load-format dummy --batch-size ${LAT_BS:-8} --input-len 512 --output-len 16 \
  --max-model-len 2048 --max-num-seqs 64 --compare hf --json "$out/latency.json" 2>&1 | tee "$out/latency.txt" | tail -30
python -m cli.main bench throughput $m --load-format dummy --num-prompts 64 --input-len 128 --output-len 32 \
  --max-model-len 2048 --max-num-seqs 64 --compare hf --json "$out/throughput.json" 2>&1 | tee "$out/throughput.txt" | tail -25
