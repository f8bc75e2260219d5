#!/usr/bin/env bash
# Start-up in one run, each a fresh process (`compiled bench startup`, weight load reported apart):
#   1. cold: nothing cached, no artifact;
#   2. an artifact on a fresh machine: exported with empty caches, which are then deleted, and
#      started with empty caches;
#   3. the same artifact with the caches that start filled (a warm machine).
# With B_TREE (another checkout: git archive BASE | tar -x -C out/base), an A/B of 2 alone: this
# tree (A) and B_TREE (B) each export the model, then start from their artifact with empty caches
# alternated A B A B (ROUNDS times, default 2).
# MODEL (default bench/configs/qwen3-30b-a3b, dummy weights); results in ${OUT:-out}/.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"; out=$(realpath "$out")
site=${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$PWD$site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
# Python's bytecode: written by the cold start, read by the starts after it (an installed torch ships it)
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$(mktemp -d)}; unset PYTHONDONTWRITEBYTECODE
model=${MODEL-bench/configs/qwen3-30b-a3b}
load=(); [ -n "$model" ] && load=(--load-format dummy)
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | tee "$out/device.txt"
startup() {   # startup NAME [flags...]; TREE (default this one) runs it
  local name=$1; shift
  (cd "${TREE:-$PWD}" && PYTHONPATH=$PWD$site python -m cli.main bench startup $model "${load[@]}" \
    --json "$out/startup_$name.json" "$@" > "$out/startup_$name.txt" 2>&1)
  echo "== $name"; grep -E "start to first|   load|capture|warm_up|inductor_import|artifact_load|Triton kernels|Error" "$out/startup_$name.txt"
}
export_artifact() {   # export_artifact DIR [TAG]: with TREE's code, caches of its own, deleted after
  local exporter; exporter=$(mktemp -d)
  (cd "${TREE:-$PWD}" && TRITON_CACHE_DIR=$exporter/triton TORCHINDUCTOR_CACHE_DIR=$exporter/inductor \
    PYTHONPATH=$PWD$site python -m cli.main export $model "${load[@]}" --out "$1" > "$out/export$2.txt" 2>&1) \
    || { tail -5 "$out/export$2.txt"; exit 1; }
  rm -rf "$exporter"   # the machine an artifact starts on never had the exporter's caches
}
if [ -n "${B_TREE:-}" ]; then
  b_tree=$(realpath "$B_TREE") art_a=$(mktemp -d)/artifact art_b=$(mktemp -d)/artifact
  export_artifact "$art_a" _A; TREE=$b_tree export_artifact "$art_b" _B
  for round in $(seq "${ROUNDS:-2}"); do
    startup "artifact_fresh_A$round" --artifact "$art_a" --fresh-caches
    TREE=$b_tree startup "artifact_fresh_B$round" --artifact "$art_b" --fresh-caches
  done
  exit 0
fi
startup cold --fresh-caches
art=$(mktemp -d)/artifact
export_artifact "$art"
startup artifact_fresh --artifact "$art" --fresh-caches
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
startup artifact_first --artifact "$art"     # fills these caches
startup artifact_warm --artifact "$art"
