#!/usr/bin/env bash
# Retune the fused-MoE table on this GPU and measure it: bench/moe_bench.py with the checked-in
# table first (BEFORE_TOKENS, default 4096; empty skips it), then bench/tune_moe.py (TMA searched;
# TUNE_FLAGS, e.g. "--merge --tokens 2048 4096") into a scratch folder, then moe_bench.py
# (MOE_FLAGS) and the GPU MoE tests with that table. The table lands in ${OUT:-out}/tuned.json, to
# be copied into compiled/moe/configs/ under the name the tuner printed. Usage (repo root, on the
# GPU to tune for): bash bench/gpu_moe_tune.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/device.txt"
if [ -n "${BEFORE_TOKENS-4096}" ]; then
  python bench/moe_bench.py --tokens ${BEFORE_TOKENS-4096} --out "$out/moe_bench_before.json" 2>&1 \
    | tee "$out/moe_bench_before.txt" | tail -4
fi
cfg=$(mktemp -d)
python bench/tune_moe.py --out-dir "$cfg" --budget-s ${TUNE_BUDGET_S:-300} ${TUNE_FLAGS:-} 2>&1 \
  | grep -E "best|BM=|variants|compiled|wrote|merging|Error" | tee "$out/tune.txt" | tail -30
cp "$cfg"/*.json "$out/tuned.json"
export COMPILED_MOE_CONFIG_DIR=$cfg
python bench/moe_bench.py --out "$out/moe_bench.json" ${MOE_FLAGS:-} 2>&1 | tee "$out/moe_bench.txt" | tail -12
python -m pytest -m gpu -q tests/moe/test_moe_kernels.py 2>&1 | tee "$out/moe_tests.txt" | tail -2
# Everything again in one archive, for copying the results off the machine.
tar -C "$out" -czf "$out/0_all_results.tgz" --exclude 0_all_results.tgz .
