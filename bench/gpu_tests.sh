#!/usr/bin/env bash
# Every GPU test (`pytest -m gpu tests`) on one GPU, spread over WORKERS processes (pytest-xdist,
# one test file a worker: a file's engines are built once for its tests). The engines the tests
# build fix their KV cache size (kv_cache_tokens) or hold small models, so they share the GPU.
# Each test's outcome as it finishes (so a run cut by TESTS_TIMEOUT, s, default 420, still names
# its failures), the summary and the slowest tests land in ${OUT:-out}/gpu_tests.txt.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
timeout "${TESTS_TIMEOUT:-420}" python -m pytest -m gpu -v -p no:cacheprovider -rfE --durations=15 \
  -n "${WORKERS:-5}" --dist loadfile tests > "$out/gpu_tests.txt" 2>&1
echo "== gpu tests (exit $?)"
grep -E " (FAILED|ERROR) |^(FAILED|ERROR) |^=+ .* in [0-9.]+s" "$out/gpu_tests.txt" | cut -c1-300 | tail -30
