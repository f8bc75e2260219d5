"""Retraction stress: many mixed requests on a KV cache far too small for them, and how much work
the scheduler's retractions (recomputation of a retracted request's tokens) cost.

The workload (fixed by `--seed`, default 0): `--num-requests` (default 1,000) requests of random
token ids, all queued at once, greedy with EOS ignored so every request runs to its length:
  - prompt: 85% short, uniform in [4, 16] tokens; 15% long, uniform in [64, 192] tokens (one to
    four chunks of the 48-token step budget);
  - max_new_tokens: uniform in [1, 16].
A `random.Random(seed)` draws, per request in order, the kind (short/long), the prompt length, the
output length, then the prompt's ids (uniform over the vocabulary). Engine (the demo MoE model by
default, CPU, float32): kv_cache_tokens=320, max_model_len=320 (the context the cache holds anyway),
max_num_seqs=16, max_num_batched_tokens=48.

Reported: tokens computed (every token of every forward pass: prefill chunks, recomputation after
a retraction, decode tokens, tokens launched ahead by overlap scheduling), tokens needed (per
request prompt + output - 1: its last token is sampled, never fed back), their ratio, engine
steps (`engine.step()` calls), retractions, and the wall time.

    python bench/retraction_stress.py [MODEL] [--num-requests 1000] [--json out.json]
    python bench/retraction_stress.py --num-requests 40 --check-solo   # outputs == solo runs
    python bench/retraction_stress.py --scheduling-only --victim newest

`--scheduling-only` replaces the forward pass by zeros (every request samples token 0, EOS
ignored): the scheduler makes the same decisions, since they depend on lengths only, so the counts
are those of the model, in a second. `--victim` swaps the scheduler's choice of the request to
retract (`Scheduler._victim`) for another rule, to compare them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VICTIMS = {
    "fewest-computed": None,   # the scheduler's own rule
    "newest": lambda candidates: candidates[-1],
    # SGLang's order: fewest output tokens, the longest prompt among equals.
    "fewest-outputs": lambda candidates: min(reversed(candidates),
                                             key=lambda r: (len(r.output_token_ids), -len(r.prompt_token_ids))),
}
ENGINE = dict(device="cpu", dtype="float32", kv_cache_tokens=320, max_model_len=320, max_num_seqs=16,
              max_num_batched_tokens=48)


def stress_workload(n: int, vocab: int, seed: int = 0, short: tuple[int, int] = (4, 16),
                    long: tuple[int, int] = (64, 192), long_fraction: float = 0.15,
                    output: tuple[int, int] = (1, 16)) -> list[tuple[list[int], int]]:
    """`n` (prompt token ids, max_new_tokens) pairs, as the module docstring describes."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        lo, hi = long if rng.random() < long_fraction else short
        length, out = rng.randint(lo, hi), rng.randint(*output)
        items.append(([rng.randrange(vocab) for _ in range(length)], out))
    return items


def run_workload(llm, items) -> tuple[dict, list]:
    """Queue every item at once, step until all finish; counts and the requests."""
    from compiled.runtime.sampling_params import SamplingParams
    engine = llm.engine
    computed = [0]
    forward, own = engine.runner.forward, engine.runner.__dict__.get("forward")

    def counting(batch, *args, **kwargs):
        computed[0] += batch.num_tokens
        return forward(batch, *args, **kwargs)

    engine.runner.forward = counting
    retractions = engine.scheduler.num_retractions
    try:
        requests = [engine.make_request(i, ids, SamplingParams(max_new_tokens=out, temperature=0.0, ignore_eos=True))
                    for i, (ids, out) in enumerate(items)]
        t0 = time.perf_counter()
        for r in requests:
            engine.add(r)
        steps = 0
        while engine.has_work:
            engine.step()
            steps += 1
        elapsed = time.perf_counter() - t0
    finally:
        if own is None:
            del engine.runner.forward
        else:
            engine.runner.forward = own
    needed = sum(len(r.prompt_token_ids) + len(r.output_token_ids) - 1 for r in requests)
    return {"requests": len(requests), "tokens_computed": computed[0], "tokens_needed": needed,
            "recompute_ratio": computed[0] / needed, "steps": steps,
            "retractions": engine.scheduler.num_retractions - retractions, "elapsed_s": elapsed}, requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="model folder (default: the demo MoE model)")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-overlap-schedule", action="store_true")
    ap.add_argument("--check-solo", action="store_true", help="also run every request alone and compare tokens")
    ap.add_argument("--scheduling-only", action="store_true", help="no model: zeros for every forward pass")
    ap.add_argument("--victim", choices=list(VICTIMS), default="fewest-computed", help="whom to retract")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from compiled import LLM
    from compiled.demo import MOE_MODEL
    model = args.model or MOE_MODEL
    llm = LLM(model, **ENGINE, overlap_schedule=not args.no_overlap_schedule)
    if VICTIMS[args.victim] is not None:
        llm.engine.scheduler._victim = VICTIMS[args.victim]
    if args.scheduling_only:
        import torch
        from compiled.runtime.model_runner import StepOutput
        vocab = llm.model_config.vocab_size

        def zeros(batch, sample_rows=(), feed=None):
            rows = len(sample_rows)
            return StepOutput(torch.zeros(batch.num_tokens, 1), torch.zeros(rows, vocab) if rows else None)
        llm.engine.runner.forward = zeros
    items = stress_workload(args.num_requests, llm.model_config.vocab_size, args.seed)
    res, requests = run_workload(llm, items)
    if args.check_solo:
        from compiled.runtime.sampling_params import SamplingParams
        solo = LLM(model, device="cpu", dtype="float32")
        same = sum(solo.generate([ids], SamplingParams(max_new_tokens=out, temperature=0.0, ignore_eos=True))[0]
                   .token_ids == r.output_token_ids for (ids, out), r in zip(items, requests))
        res["equal_to_solo"] = f"{same}/{len(items)}"
    print(f"{res['requests']} requests: tokens computed {res['tokens_computed']:,} / needed "
          f"{res['tokens_needed']:,} = {res['recompute_ratio']:.3f}x; {res['steps']:,} steps, "
          f"{res['retractions']:,} retractions, {res['elapsed_s']:.1f} s"
          + (f"; equal to solo {res['equal_to_solo']}" if "equal_to_solo" in res else ""))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "engine": ENGINE,
                                         "results": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
