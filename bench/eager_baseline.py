"""Pre-compile baseline: eager decode step time of the engine beside HF transformers, same run.

Real shapes with random weights (`load_format="dummy"`), bf16, context ~512. Writes JSON to
--out and prints a table. Usage: python bench/eager_baseline.py --model bench/configs/qwen3-30b-a3b
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from compiled import LLM, SamplingParams


def time_ours(llm: LLM, batch: int, context: int, steps: int) -> dict:
    engine = llm.engine
    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_new_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(0, vocab, (context,), generator=g).tolist()
        engine.add(engine.make_request(i, ids, params))
    # Prefill until every request is decoding.
    while any(r.num_computed < len(r.prompt_token_ids) for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    while engine.has_work:
        engine.step()
    return {"median_ms": 1e3 * statistics.median(times[2:]), "min_ms": 1e3 * min(times)}


def time_hf(model_dir: str, batch: int, context: int, steps: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
    cfg = AutoConfig.from_pretrained(model_dir)
    kwargs = {"experts_implementation": "grouped_mm"} if "Moe" in cfg.architectures[0] else {}
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, **kwargs).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, context), device="cuda")
    times = []
    with torch.no_grad():
        cache = DynamicCache(config=cfg)
        out = model(ids, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    del model, cache, out
    gc.collect()
    torch.cuda.empty_cache()
    return {"median_ms": 1e3 * statistics.median(times[2:]), "min_ms": 1e3 * min(times)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench/configs/qwen3-30b-a3b")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--hf", action="store_true", help="also time HF transformers in this run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    llm = LLM(args.model, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=4096,
              max_num_seqs=max(batches), max_num_batched_tokens=8192)
    load_s = time.perf_counter() - t0
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
               "context": args.context, "load_s": load_s, "ours_eager": {}, "hf": {}}
    smoke = llm.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    results["smoke_tokens"] = smoke.token_ids
    for b in batches:
        results["ours_eager"][b] = time_ours(llm, b, args.context, args.steps)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    if args.hf:
        for b in batches:
            results["hf"][b] = time_hf(args.model, b, args.context, args.steps)
    print(f"\n{results['device']}  {args.model}  context {args.context}  (load {load_s:.1f}s)")
    print(f"{'batch':>6} {'ours eager ms':>14} {'HF ms':>10}")
    for b in batches:
        hf = results["hf"].get(b, {}).get("median_ms", float("nan"))
        print(f"{b:>6} {results['ours_eager'][b]['median_ms']:>14.1f} {hf:>10.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
