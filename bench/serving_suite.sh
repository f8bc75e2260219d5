#!/usr/bin/env bash
# The serving workloads through a real `compiled serve` (HTTP), each beside what it is compared
# with, on one machine; results in ${OUT:-out}/.
#   1. random 2,048 in / 1,024 out at concurrency 10: over HTTP and in-process (same engine settings);
#   2. 256-1,024 in / 600-1,200 out at concurrency 96 (inter-token latency p50 / p99), also in-process;
#   3. a 1,000-token shared prefix, 32 concurrent: the server with and without its prefix cache, with
#      128 output tokens each (requests end and arrive in waves of 32) and with 64-192 (they spread out).
# Each run also prints the engine's mean step time during it (HTTP: from the server's /metrics),
# whose difference from the in-process run's is what the front end costs the engine, and over HTTP
# the mean time to first token in phases (the server's inbox, its queue, the prefill step).
# MODEL (default bench/configs/qwen3-30b-a3b, dummy weights); SCALE divides the request counts and
# lengths (e.g. SCALE=32 MODEL= for the demo model on a CPU); SERVE_FLAGS go to `compiled serve`,
# ENGINE_FLAGS (engine options, e.g. "--max-mixed-step-tokens 1024") to it and to the in-process run;
# CLIENTS (default 4): client processes sending the HTTP workloads (one Python process reading 32-96
# streams delays its own sends); PARTS (default "random mixed shared"): the workloads 1-3 to run.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
model=${MODEL-bench/configs/qwen3-30b-a3b}
load=(); [ -n "$model" ] && load=(--load-format dummy)
s=${SCALE:-1}
port=${PORT:-8400}
url=http://127.0.0.1:$port

serve() {   # serve NAME [flags...]: start a server, wait until it answers
  local name=$1; shift
  python -m cli.main serve $model "${load[@]}" --port "$port" ${ENGINE_FLAGS:-} ${SERVE_FLAGS:-} "$@" \
    > "$out/serve_$name.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    curl -sf "$url/health" > /dev/null && return 0
    kill -0 "$server" 2> /dev/null || break   # it exited: no point waiting
    sleep 1
  done
  echo "server $name did not start"; tail -5 "$out/serve_$name.log"; return 1
}
stop() { kill -TERM "$server"; wait "$server"; echo "server exited with $?"; }
bench() {   # bench NAME [flags...]; then the engine's mean step time during it
  local name=$1; shift
  local http=0 clients=(); [[ " $* " == *" --url "* ]] && http=1 clients=(--client-processes "${CLIENTS:-4}")
  local summaries="^compiled_(engine_step|first_token_[a-z]+)_seconds"
  [ $http = 1 ] && curl -s "$url/metrics" | grep -E "$summaries" > "$out/${name}_steps_before.txt"
  python -m cli.main bench serving $model "${load[@]}" --json "$out/$name.json" "${clients[@]}" "$@" > "$out/$name.txt" 2>&1
  echo "== $name"; grep -E "output tokens/s|Triton kernels|time to first|time per output|inter-token|Error|error" "$out/$name.txt"
  if [ $http = 1 ]; then   # /metrics sums since the server started: the difference over this run
    curl -s "$url/metrics" | grep -E "$summaries" > "$out/${name}_steps_after.txt"
    awk '{name = $1; sub(/_(sum|count)$/, "", name); key = name ($1 ~ /_sum$/ ? " sum" : " count")}
         FNR == NR {before[key] = $2; next} {after[key] = $2; names[name] = 1}
         END {for (n in names) { c = after[n " count"] - before[n " count"]
                if (c > 0) printf "%s mean (ms): %.3f\n", n, 1e3 * (after[n " sum"] - before[n " sum"]) / c }}' \
      "$out/${name}_steps_before.txt" "$out/${name}_steps_after.txt" \
      | sed -e 's/^compiled_engine_step_seconds/engine step/' -e 's/^compiled_first_token_\([a-z]*\)_seconds/first token, \1,/' | sort
  else
    python -c "import json, sys; print('engine step mean (ms): %.3f' % json.load(open(sys.argv[1]))['results']['step_ms_mean'])" \
      "$out/$name.json"
  fi
}
random_10=(--num-prompts $((40 / s)) --input-len $((2048 / s)) --output-len $((1024 / s)) --max-concurrency 10)
mixed_96=(--num-prompts $((300 / s)) --input-len $((256 / s)) --input-len-max $((1024 / s))
          --output-len $((600 / s)) --output-len-max $((1200 / s)) --max-concurrency 96)
shared_32=(--num-prompts $((128 / s)) --shared-prefix-len $((1000 / s)) --input-len $((64 / s))
           --output-len $((128 / s)) --max-concurrency 32)
shared_32_varied=("${shared_32[@]}" --output-len $((64 / s)) --output-len-max $((192 / s)))
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | tee "$out/device.txt"

parts=" ${PARTS:-random mixed shared} "
has() { [[ $parts == *" $1 "* ]]; }
serve cache || exit 1
has random && bench http_random_10 --url "$url" "${random_10[@]}"
has mixed && bench http_mixed_96 --url "$url" "${mixed_96[@]}"
if has shared; then
  bench http_shared_32 --url "$url" "${shared_32[@]}"
  bench http_shared_32_varied --url "$url" "${shared_32_varied[@]}"
fi
stop
if has shared; then
  serve no_cache --no-prefix-cache || exit 1
  bench http_shared_32_no_cache --url "$url" "${shared_32[@]}"
  bench http_shared_32_varied_no_cache --url "$url" "${shared_32_varied[@]}"
  stop
fi
has random && bench inproc_random_10 ${ENGINE_FLAGS:-} "${random_10[@]}"
has mixed && bench inproc_mixed_96 ${ENGINE_FLAGS:-} --prefix-cache "${mixed_96[@]}"
exit 0
