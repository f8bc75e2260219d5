"""Decode step time at several batch sizes with long contexts, in one engine: how a batch that is
not a bucket size (padded to the next bucket) compares with its neighbours.

usage: python bench/decode_batches.py [MODEL] [--context 2048] [--batches 8,9,10,12,16,24]
MODEL defaults to bench/configs/qwen3-30b-a3b with dummy weights. Each batch runs twice (the
first captures a bucket it may need); the second's mean step over 65 tokens is printed."""

from __future__ import annotations

import argparse
import random
import time

import torch

from compiled import LLM, SamplingParams


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_ms(llm: LLM, batch: int, context: int, rng: random.Random) -> float:
    engine = llm.engine
    greedy = SamplingParams(max_new_tokens=80, ignore_eos=True, temperature=0.0)
    vocab = llm.engine.model_config.vocab_size
    requests = [engine.make_request(i, [rng.randrange(vocab) for _ in range(context)], greedy)
                for i in range(batch)]
    for r in requests:
        engine.add(r)
    while any(len(r.output_token_ids) < 5 for r in requests):   # prefill and settle
        engine.step()
    sync()
    start, steps = time.perf_counter(), 0
    while all(len(r.output_token_ids) < 70 for r in requests):
        engine.step()
        steps += 1
    sync()
    seconds = time.perf_counter() - start
    while engine.has_work:
        engine.step()
    return 1e3 * seconds / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="bench/configs/qwen3-30b-a3b")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batches", default="8,9,10,12,16,24")
    args = p.parse_args()
    llm = LLM(args.model, load_format="dummy")
    rng = random.Random(0)
    for batch in (int(b) for b in args.batches.split(",")):
        step_ms(llm, batch, args.context, rng)
        print(f"batch {batch}, context {args.context}: {step_ms(llm, batch, args.context, rng):.3f} ms a step",
              flush=True)


if __name__ == "__main__":
    main()
