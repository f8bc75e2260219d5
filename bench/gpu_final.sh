#!/usr/bin/env bash
# A short GPU run, most important first: loader memory on the GPU, `compiled bench latency` and
# `throughput` on the Qwen3-30B-A3B shape with --compare hf, then compiled+graphs vs uncompiled.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
python -m pytest -m gpu -q -s tests/test_load_memory.py 2>&1 | tee "$out/load_memory.txt" | grep -E "ratio|passed|failed"
m=bench/configs/qwen3-30b-a3b
common="--load-format dummy --max-model-len 2048 --max-num-seqs 64 ${BENCH_MODE:---enforce-eager} --compare hf"
python -m cli.main bench latency $m $common --batch-size 8 --input-len 512 --output-len 16 \
  --json "$out/latency.json" 2>&1 | tee "$out/latency.txt" | tail -30
python -m cli.main bench throughput $m $common --num-prompts 32 --input-len 128 --output-len 16 \
  --json "$out/throughput.json" 2>&1 | tee "$out/throughput.txt" | tail -25
python -m pytest -m gpu -q -s tests/test_gpu_compile.py 2>&1 | tee "$out/gpu_compile.txt" | grep -E "batch [0-9]+:|passed|failed|Error" | tail -20
