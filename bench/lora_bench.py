"""Decode step with and without LoRA: the same engine serves batches whose requests use no
adapter and batches spread over N random adapters of rank R (real shapes, no files).

    python bench/lora_bench.py bench/configs/qwen3-30b-a3b --num-loras 8 --rank 16 --batches 1,8,64

Prints one line per batch (decode step p50 in ms: base, LoRA, and their ratio) and writes JSON
with --out. The adapters go round-robin over the batch's requests; `--targets` picks the
projections (all: attention, MLP and MoE experts)."""

from __future__ import annotations

import argparse
import json
import time

import torch

from cli import bench_core as core
from compiled import LLM
from compiled.lora.random import TARGETS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--num-loras", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", choices=sorted(TARGETS), default="all")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    start = time.perf_counter()
    llm = LLM(a.model, load_format="dummy", enable_lora=True, max_lora_rank=a.rank, max_loras_per_batch=a.num_loras,
              max_num_seqs=max(batches), max_model_len=a.input_len + a.output_len + 16)
    names = core.add_random_loras(llm, a.num_loras, a.rank, a.targets, seed=0)
    record = {"model": a.model, "environment": core.environment(llm.config.device), "num_loras": a.num_loras,
              "rank": a.rank, "targets": a.targets, "startup_s": time.perf_counter() - start,
              "startup_stages_s": llm.startup_seconds, "decode": {}}
    print(f"started in {record['startup_s']:.1f} s", flush=True)
    for b in batches:
        loras = [names[i % a.num_loras] for i in range(b)]
        base, _ = core.latency(llm, b, a.input_len, a.output_len, a.iters, 1, 0)
        lora, _ = core.latency(llm, b, a.input_len, a.output_len, a.iters, 1, 0, loras=loras)
        p50 = base["decode_step_ms"]["p50"], lora["decode_step_ms"]["p50"]
        record["decode"][b] = {"base": base, "lora": lora}
        print(f"batch {b}: decode p50 base {p50[0]:.3f} ms, {min(b, a.num_loras)} adapters {p50[1]:.3f} ms "
              f"({p50[0] / p50[1]:.1%} of base throughput)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1, default=str)
    if torch.cuda.is_available():
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
