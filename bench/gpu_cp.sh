#!/usr/bin/env bash
# Context parallelism on one host with CP_SIZE GPUs (default 2): the GPU tests of the CP code, then
# bench/cp_bench.py on the Qwen3-30B-A3B shape (dummy weights, bf16): time to first token per prompt
# length beside CP=1 and prompt-logprob / greedy checks, then `compiled bench latency --cp` at
# 32k tokens. PROFILE_LENGTH=N also profiles rank 0's prefill of N tokens (traces in ${OUT:-out}/trace).
# NVLink multicast stays off. Results in ${OUT:-out}/.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"; cp_size=${CP_SIZE:-2}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
nvidia-smi topo -m > "$out/topo.txt" 2>&1
if [ -z "${SKIP_TESTS:-}" ]; then
  python -m pytest -m gpu -q tests/parallel 2>&1 | tee "$out/gpu_tests.txt" | tail -5
fi
python bench/cp_bench.py bench/configs/qwen3-30b-a3b --cp "$cp_size" \
  --lengths "${LENGTHS:-1024,2048,4096,8192,16384,32768}" --check "${CHECK:-8192,32768}" \
  ${PROFILE_LENGTH:+--profile "$out/trace" --profile-length "$PROFILE_LENGTH"} \
  --out "$out/cp$cp_size.json" 2>&1 | tee "$out/cp$cp_size.txt" | grep -vE "^\s*$|Warning"
if [ -z "${SKIP_LATENCY:-}" ]; then
  python -m cli.main bench latency bench/configs/qwen3-30b-a3b --load-format dummy --cp "$cp_size" \
    --batch-size 1 --input-len 32768 --output-len 1 --num-iters 3 --num-iters-warmup 1 \
    --max-num-batched-tokens 32768 --max-model-len 33024 --kv-cache-tokens 34000 --max-num-seqs 1 \
    --json "$out/latency_cp$cp_size.json" > "$out/latency_cp$cp_size.txt" 2>&1
  grep -E "first token|Error" "$out/latency_cp$cp_size.txt"
fi
