#!/usr/bin/env bash
# End-to-end and start-up numbers in one run: bench/e2e_suite.py on the Qwen3-30B-A3B shape (cold
# caches, export), a warm start from its artifact in a fresh process (with and without torch's
# bytecode cache), then the Qwen3-0.6B shape. Results go to ${OUT:-out}/.
# Usage (repo root, on a CUDA machine): bash bench/gpu_e2e.sh. Optional, before the end-to-end runs:
# GPU_TESTS="tests/..." (pytest -m gpu), MOE_BENCH=1 [MOE_FLAGS], LINEAR_BENCH=1 [LINEAR_FLAGS],
# ATTN_BENCH=1 [ATTN_FLAGS] (bench/moe_bench.py, linear_bench.py, attention_bench.py); E2E_FLAGS and
# WARM_FLAGS (e.g. "--cprofile out/warm.prof.txt") go to the cold and warm e2e_suite runs.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
# An installed torch has its modules compiled to bytecode (pip does it at install time). A venv
# without __pycache__, or with PYTHONDONTWRITEBYTECODE set, compiles torch's sources in every
# process (~1.8 s of a warm start). Here the first process writes bytecode to a cache that the
# later ones read, as on an installed system; the warm start is also run once without it.
export PYTHONPYCACHEPREFIX=$(mktemp -d); unset PYTHONDONTWRITEBYTECODE
if [ -n "${GPU_TESTS:-}" ]; then
  python -m pytest -m gpu -q -s $GPU_TESTS 2>&1 | tee "$out/gpu_tests.txt" | grep -E "batch [0-9]+:|passed|failed|Error" | tail -30
fi
if [ -n "${MOE_BENCH:-}" ]; then   # MOE_FLAGS: e.g. "--profile 1 4096 --sweep-one-token"
  python bench/moe_bench.py --out "$out/moe_bench.json" ${MOE_FLAGS:-} 2>&1 | tee "$out/moe_bench.txt" | tail -16
fi
if [ -n "${LINEAR_BENCH:-}" ]; then
  python bench/linear_bench.py --out "$out/linear_bench.json" ${LINEAR_FLAGS:-} 2>&1 | tee "$out/linear_bench.txt" | tail -40
fi
if [ -n "${ATTN_BENCH:-}" ]; then
  python bench/attention_bench.py --out "$out/attn_bench.json" ${ATTN_FLAGS:-} 2>&1 | tee "$out/attn_bench.txt" | tail -24
fi
# cold: nothing cached (the tests and benchmarks above fill caches of their own)
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
art=$(mktemp -d)/qwen3-30b-a3b
python bench/e2e_suite.py bench/configs/qwen3-30b-a3b --out "$out/e2e_30b.json" --export "$art" \
  --profile-dir "$out/prof_30b" ${E2E_FLAGS:-} 2>&1 | tee "$out/e2e_30b.txt" | grep -v "^ *\"" | tail -80
python bench/e2e_suite.py bench/configs/qwen3-30b-a3b --out "$out/warm_30b.json" --artifact "$art" ${WARM_FLAGS:-} 2>&1 \
  | tee "$out/warm_30b.txt" | tail -30
env -u PYTHONPYCACHEPREFIX PYTHONDONTWRITEBYTECODE=1 python bench/e2e_suite.py bench/configs/qwen3-30b-a3b \
  --out "$out/warm_30b_no_bytecode.json" --artifact "$art" 2>&1 | tee "$out/warm_30b_no_bytecode.txt" | grep excluding
python bench/e2e_suite.py bench/configs/qwen3-0.6b --out "$out/e2e_06b.json" --batches 1 \
  --profile-dir "$out/prof_06b" 2>&1 | tee "$out/e2e_06b.txt" | grep -v "^ *\"" | tail -40
rm -rf "$out"/prof_*/*.json
# Everything again in one archive, for copying the results off the machine.
tar -C "$out" -czf "$out/0_all_results.tgz" --exclude 0_all_results.tgz .
