#!/usr/bin/env bash
# `compiled bench latency` at the batches and lengths of CASES ("batch:input:output" each; default
# the long-context rows of the decode table), on MODEL (default bench/configs/qwen3-30b-a3b, dummy
# weights); one JSON and one table per case in ${OUT:-out}/, the decode step medians printed last.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
model=${MODEL:-bench/configs/qwen3-30b-a3b}
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | tee "$out/device.txt"
for case in ${CASES:-8:32768:96 256:1024:32}; do
  IFS=: read -r batch input output <<< "$case"
  tag="latency_b${batch}_in${input}_out${output}"
  python -m cli.main bench latency "$model" --load-format dummy --batch-size "$batch" --input-len "$input" \
    --output-len "$output" --num-iters "${ITERS:-3}" --num-iters-warmup "${WARMUP:-1}" \
    --json "$out/$tag.json" ${EXTRA:-} > "$out/$tag.txt" 2>&1
  echo "== $tag (exit $?)"
  grep -E "decode step|decode timed|time to first|prefill steps|floor|roofline|not timed|retractions|rror" "$out/$tag.txt"
done
