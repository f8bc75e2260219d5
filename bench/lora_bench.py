"""Decode step and prefill with and without LoRA. One process measures one engine:

    python bench/lora_bench.py bench/configs/qwen3-30b-a3b --base --out base.json
    python bench/lora_bench.py bench/configs/qwen3-30b-a3b --num-loras 8 --rank 16 --out lora.json

`--base`: an engine without LoRA (the reference). Otherwise an engine with N random adapters of rank
R in the model's real shapes (no files) is measured twice per batch: with no request using an
adapter (LoRA enabled but idle) and with the adapters round-robin over the batch's requests. Each
run also times a prefill of `--prefill-len` tokens (with the first adapter, and idle) and
profiles one decode step at each `--profile-batches` and the prefill. Prints one line per
measurement and writes JSON with --out; `bench/lora_compare.py` puts a base and a LoRA file side by
side."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cli import bench_core as core
from compiled import LLM
from compiled.lora.random import TARGETS


def prefill_ms(llm, length: int, reps: int, lora: str | None) -> list[float]:
    prompt = core.random_ids(1, length, llm.model_config.vocab_size, 1)[0]
    core.first_token(llm, prompt, lora)    # warm-up
    return [1e3 * core.first_token(llm, prompt, lora) for _ in range(reps)]


def profile(llm, batch: int, input_len: int, loras: list[str | None], decode: bool,
            output_len: int = 1, top: int = 12) -> dict | None:
    """Kernels per step, the top kernels by GPU time and those on the critical path (own time not
    overlapped, `exposed`) of three decode steps at `batch` (requests of `output_len` tokens, enough
    to outlast the batch's prefill), or of the prefill of `batch` prompts of `input_len` tokens."""
    if llm.config.device.type != "cuda":
        return None
    prompts = core.random_ids(batch, input_len, llm.model_config.vocab_size, 2)
    items = [core.Item(p, output_len if decode else 1, a) for p, a in zip(prompts, loras)]
    with tempfile.TemporaryDirectory() as d:
        prof = core.profile_steps(llm, items, 3 if decode else 1, Path(d), "step", skip_prefill=decode, top=top)
    return {"kernels_per_step": prof["kernels_per_step"], "top": prof["top"], "exposed": prof["exposed"]}


def print_top(name: str, prof: dict | None) -> None:
    if prof:
        print(f"{name}: {prof['kernels_per_step']} kernels per step; top kernels (ms over the profiled steps):")
        for row in prof["top"]:
            print(f"    {row['self_ms']:8.3f} {row['calls']:6d}  {row['name'][:110]}")
        print("  on the critical path (own time not overlapped + idle before, ms over the steps):")
        for row in prof["exposed"]:
            print(f"    {row['exposed_ms']:8.3f} ({row['idle_before_ms']:.3f}) {row['calls']:6d}  {row['name'][:100]}")


def measure(llm, name: str, batches: list[int], a, adapters: list[str]) -> dict:
    """Decode per batch, prefill and the kernel count, every request on `adapters` round-robin
    (empty: the base model)."""
    pick = (lambda i: adapters[i % len(adapters)]) if adapters else (lambda i: None)
    out: dict = {"decode": {}}
    for b in batches:
        loras = [pick(i) for i in range(b)]
        res, _ = core.latency(llm, b, a.input_len, a.output_len, a.iters, 1, 0, loras=loras)
        out["decode"][b] = res
        print(f"{name} batch {b}: decode p50 {res['decode_step_ms']['p50']:.3f} ms", flush=True)
    ms = prefill_ms(llm, a.prefill_len, a.prefill_reps, pick(0))
    out["prefill_ms"] = ms
    print(f"{name} prefill {a.prefill_len}: median {statistics.median(ms):.2f} ms {[round(x, 2) for x in ms]}",
          flush=True)
    out["profile"] = {}
    for b in a.profile_batches:
        out["profile"][b] = profile(llm, b, a.input_len, [pick(i) for i in range(b)], True, a.output_len,
                                    a.profile_top)
        print_top(f"{name} decode batch {b}", out["profile"][b])
    out["profile"]["prefill"] = profile(llm, 1, a.prefill_len, [pick(0)], False, top=a.profile_top)
    print_top(f"{name} prefill {a.prefill_len}", out["profile"]["prefill"])
    out["kernels_per_step"] = (out["profile"].get(8) or {}).get("kernels_per_step")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--base", action="store_true", help="an engine without LoRA")
    ap.add_argument("--num-loras", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", choices=sorted(TARGETS), default="all")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--profile-batches", default="8", help="decode batches profiled (kernels per step, top kernels)")
    ap.add_argument("--profile-top", type=int, default=12, help="kernels listed per profile (by GPU time and exposed)")
    ap.add_argument("--skip-idle", action="store_true", help="with adapters: skip the idle measurement")
    ap.add_argument("--merge-lora", action="store_true", help="fold a batch's one adapter into the weights "
                    "(merge_lora)")
    ap.add_argument("--quantization", default=None, help="quantize the weights at load (fp8)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    a.profile_batches = [int(b) for b in a.profile_batches.split(",") if b]
    start = time.perf_counter()
    lora = {} if a.base else dict(enable_lora=True, max_lora_rank=a.rank, max_loras_per_batch=a.num_loras,
                                  merge_lora=a.merge_lora)
    llm = LLM(a.model, load_format="dummy", max_num_seqs=max(batches), quantization=a.quantization,
              max_model_len=max(a.input_len + a.output_len, a.prefill_len) + 16, **lora)
    names = [] if a.base else core.add_random_loras(llm, a.num_loras, a.rank, a.targets, seed=0)
    record = {"model": a.model, "environment": core.environment(llm.config.device),
              "adapters": None if a.base else {"num_loras": a.num_loras, "rank": a.rank, "targets": a.targets,
                                               "merge_lora": a.merge_lora},
              "startup_s": time.perf_counter() - start, "startup_stages_s": llm.startup_seconds}
    print(f"started in {record['startup_s']:.1f} s", flush=True)
    if a.base:
        record["base"] = measure(llm, "base", batches, a, [])
    else:
        if not a.skip_idle:
            record["idle"] = measure(llm, "idle", batches, a, [])
        record["lora"] = measure(llm, f"{a.num_loras} adapters", batches, a, names)
    if torch.cuda.is_available():
        record["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
        print(f"peak GPU memory {record['peak_gpu_gib']:.1f} GiB")
    if a.out:
        Path(a.out).write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
