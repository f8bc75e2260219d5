"""Distinct experts a decode step reads per MoE layer, measured, beside the uniform-routing
expectation that the bandwidth floor of `compiled bench latency` assumes (`cli/roofline.py`).

usage: python bench/routing_spread.py [MODEL] [--batches 1,8,10,16] [--context 2048] [--steps 16]

MODEL defaults to bench/configs/qwen3-30b-a3b with dummy weights (the serving benchmarks' model).
The engine runs eagerly so that every routing call reaches Python, where its expert ids are
counted; each batch of random prompts decodes `--steps` tokens after its prefill."""

from __future__ import annotations

import argparse
import random
import statistics

import torch

import compiled.moe.routing as routing
from cli.roofline import expected_experts
from compiled import LLM, SamplingParams


class ExpertCounter:
    """Wraps the routing op's implementation: the distinct experts of each call with `rows` rows."""

    def __init__(self) -> None:
        self.rows: int | None = None
        self.counts: list[int] = []

    def wrap(self, route):
        def counted(router_logits: torch.Tensor, top_k: int, renormalize: bool):
            weights, ids = route(router_logits, top_k, renormalize)
            if self.rows is not None and ids.shape[0] == self.rows:
                self.counts.append(int(torch.unique(ids).numel()))
            return weights, ids
        return counted


def decode_spread(llm: LLM, counter: ExpertCounter, batch: int, context: int, steps: int,
                  rng: random.Random) -> list[int]:
    engine = llm.engine
    params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True, temperature=0.0)
    vocab = engine.model_config.vocab_size
    requests = [engine.make_request(i, [rng.randrange(vocab) for _ in range(context)], params) for i in range(batch)]
    for r in requests:
        engine.add(r)
    while engine.has_work and not all(r.output_token_ids for r in requests):   # prefill, not counted
        engine.step()
    counter.rows, counter.counts = batch, []
    while engine.has_work:
        engine.step()
    counter.rows = None
    return counter.counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="bench/configs/qwen3-30b-a3b")
    p.add_argument("--batches", default="1,8,10,16")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    counter = ExpertCounter()
    for name in ("topk_route_ref", "topk_route_triton"):
        setattr(routing, name, counter.wrap(getattr(routing, name)))
    llm = LLM(args.model, load_format="dummy", enforce_eager=True, overlap_schedule=False)
    cfg = llm.model_config
    rng = random.Random(0)
    print(f"{cfg.num_experts} experts, top {cfg.num_experts_per_tok}; context {args.context}, {args.steps} decode steps")
    for batch in (int(b) for b in args.batches.split(",")):
        counts = decode_spread(llm, counter, batch, args.context, args.steps, rng)
        expected = expected_experts(cfg.num_experts, cfg.num_experts_per_tok, batch)
        if not counts:   # e.g. the KV cache did not hold the whole batch at once
            print(f"batch {batch}: no decode step ran all {batch} rows", flush=True)
            continue
        print(f"batch {batch}: {statistics.mean(counts):.1f} experts a layer measured (min {min(counts)}, "
              f"max {max(counts)}, {len(counts)} layer-steps); uniform routing: {expected:.1f}", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
