#!/usr/bin/env bash
# Start-up in one run, each a fresh process (`compiled bench startup`, weight load reported apart):
#   1. cold: nothing cached, no artifact;
#   2. an artifact on a fresh machine: exported with empty caches, which are then deleted, and
#      started with empty caches;
#   3. the same artifact with the caches that start filled (a warm machine).
# MODEL (default bench/configs/qwen3-30b-a3b, dummy weights); results in ${OUT:-out}/.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
# Python's bytecode: written by the cold start, read by the starts after it (an installed torch ships it)
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$(mktemp -d)}; unset PYTHONDONTWRITEBYTECODE
model=${MODEL-bench/configs/qwen3-30b-a3b}
load=(); [ -n "$model" ] && load=(--load-format dummy)
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | tee "$out/device.txt"
startup() {   # startup NAME [flags...]
  local name=$1; shift
  python -m cli.main bench startup $model "${load[@]}" --json "$out/startup_$name.json" "$@" > "$out/startup_$name.txt" 2>&1
  echo "== $name"; grep -E "start to first|   load|capture|warm_up|inductor_import|artifact_load|Triton kernels|Error" "$out/startup_$name.txt"
}
startup cold --fresh-caches
art=$(mktemp -d)/artifact exporter=$(mktemp -d)
TRITON_CACHE_DIR=$exporter/triton TORCHINDUCTOR_CACHE_DIR=$exporter/inductor \
  python -m cli.main export $model "${load[@]}" --out "$art" > "$out/export.txt" 2>&1 || { tail -5 "$out/export.txt"; exit 1; }
rm -rf "$exporter"   # the machine an artifact starts on never had the exporter's caches
startup artifact_fresh --artifact "$art" --fresh-caches
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
startup artifact_first --artifact "$art"     # fills these caches
startup artifact_warm --artifact "$art"
