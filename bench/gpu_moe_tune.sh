#!/usr/bin/env bash
# Retune the fused-MoE table on this GPU and measure it: bench/tune_moe.py (all token counts,
# TMA searched) into a scratch folder, then bench/moe_bench.py and the GPU MoE tests with that
# table. The table lands in ${OUT:-out}/tuned.json, to be copied into compiled/moe/configs/ under
# the name the tuner printed.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/device.txt"
cfg=$(mktemp -d)
python bench/tune_moe.py --out-dir "$cfg" --budget-s ${TUNE_BUDGET_S:-300} ${TUNE_FLAGS:-} 2>&1 \
  | grep -E "best|variants|compiled|wrote|Error" | tee "$out/tune.txt" | tail -20
cp "$cfg"/*.json "$out/tuned.json"
export COMPILED_MOE_CONFIG_DIR=$cfg
python bench/moe_bench.py --out "$out/moe_bench.json" 2>&1 | tee "$out/moe_bench.txt" | tail -9
python -m pytest -m gpu -q tests/test_moe_kernels.py 2>&1 | tail -2
