#!/usr/bin/env bash
# A/B on one machine, alternated (A B A B) so that clock drift and a warm or cold host affect both
# alike: bench/e2e_suite.py per model as it is (A) and with PASSES_B as its pass list and/or B_ENV
# in its environment and/or the code of B_TREE (B). Optional GPU_TESTS="tests/..." (pytest -m gpu)
# first. Results in ${OUT:-out}/.
#   PASSES_B=fuse_qkv,fuse_w13,silu_and_mul,skinny_linear | B_ENV="COMPILED_PDL=0"
#   B_TREE=out/base (another checkout: mkdir -p out/base && git archive BASE | tar -x -C out/base)
#   [MODELS="qwen3-30b-a3b:1,8 qwen3-0.6b:1"] [ROUNDS=2] [PREFILL_REPS: 2,048-token prefills timed a run, default 7, with LORA 5]
#   SIDES="B A": each round starts with B (a check that the order does not favour a side)
#   LORA=8: bench/lora_bench.py with that many random rank-16 adapters on every target instead
#   (decode and the 2,048-token prefill; no decode profiles)
#   FLAGS="--quantization fp8": more flags for both sides' bench script
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
site=${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$PWD$site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
export PYTHONPYCACHEPREFIX=$(mktemp -d); unset PYTHONDONTWRITEBYTECODE
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
if [ -n "${GPU_TESTS:-}" ]; then
  python -m pytest -m gpu -q $GPU_TESTS 2>&1 | tee "$out/gpu_tests.txt" | grep -E "passed|failed|Error" | tail -30
fi
for entry in ${MODELS:-qwen3-30b-a3b:1,8 qwen3-0.6b:1}; do
  name=${entry%%:*}; batches=${entry#*:}
  label="${name}_b${batches//,/-}"   # a model listed twice (other batches) keeps both results
  for round in $(seq "${ROUNDS:-2}"); do
    for side in ${SIDES:-A B}; do
      passes=(); envs=(); tree=$PWD
      if [ "$side" = B ]; then
        [ -n "${PASSES_B:-}" ] && passes=(--passes "$PASSES_B")
        envs=(${B_ENV:-})
        [ -n "${B_TREE:-}" ] && tree=$(realpath "$B_TREE") && envs+=(PYTHONPATH="$tree$site")
      fi
      prof=(); [ "$round" = 1 ] && prof=(--profile-dir "$out/prof_${label}_$side")
      tag="${label}_${side}${round}"
      if [ -n "${LORA:-}" ]; then
        env "${envs[@]}" python "$tree/bench/lora_bench.py" "bench/configs/$name" --out "$out/$tag.json" \
          --batches "$batches" --num-loras "$LORA" --rank 16 --skip-idle --profile-batches "" \
          --prefill-reps "${PREFILL_REPS:-5}" ${FLAGS:-} > "$out/$tag.txt" 2>&1
      else
        env "${envs[@]}" python "$tree/bench/e2e_suite.py" "bench/configs/$name" --out "$out/$tag.json" \
          --batches "$batches" --max-num-seqs "$(echo "$batches" | tr , '\n' | sort -n | tail -1)" "${passes[@]}" \
          --prefill-reps "${PREFILL_REPS:-7}" ${FLAGS:-} \
          "${prof[@]}" > "$out/$tag.txt" 2>&1
      fi
      echo "== $tag"; grep -E "^batch|^prefill|adapters batch|adapters prefill|Error|error" "$out/$tag.txt" | head -6
    done
  done
done
rm -rf "$out"/prof_*/*.json
sleep 1   # let the last writes settle before the archive
# Everything again in one archive, for copying the results off the machine.
tar -C "$out" -czf "$out/0_all_results.tgz" --exclude 0_all_results.tgz .
