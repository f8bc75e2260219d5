"""Host time of the scheduler admitting a burst behind a cached prefix: a request with a
`--prefix-len`-token system prompt runs once (its prompt stays cached), then waves of `--burst`
requests arrive together, each the same prefix and `--tail` tokens of its own, and run a few
decode steps. Prints each wave's step times (the first admits the whole wave). No model: the
scheduler alone, on the CPU.

    python bench/scheduler_burst.py --burst 32 --prefix-len 1000 --tail 64
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from compiled import SamplingParams
from compiled.attention.kv_cache import KVPool, ReqToTokenPool
from compiled.runtime.request import Request
from compiled.runtime.scheduler import Scheduler


def step_ms(s: Scheduler) -> float:
    """One scheduled step, each chunk ending its prompt sampling a token: the schedule's time."""
    t = time.perf_counter()
    batch = s.schedule()
    ms = 1e3 * (time.perf_counter() - t)
    for c in batch.chunks:
        if c.samples:
            c.request.output_token_ids.append(3)
            if len(c.request.output_token_ids) == c.request.params.max_new_tokens:
                s.finish(c.request)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--waves", type=int, default=3)
    args = ap.parse_args()
    length = args.prefix_len + args.tail
    kv = KVPool(1, 4 * args.burst * length, 1, 4, torch.float32, torch.device("cpu"))
    s = Scheduler(kv, ReqToTokenPool(2 * args.burst, 2 * length, torch.device("cpu")), 2 * args.burst,
                  8192, prefix_cache=True)
    rng = random.Random(0)
    prefix = [rng.randrange(150_000) for _ in range(args.prefix_len)]

    def request(i: int, steps: int) -> Request:
        tail = [rng.randrange(150_000) for _ in range(args.tail)]
        params = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)
        return Request(id=i, prompt=None, prompt_token_ids=prefix + tail, params=params)

    s.add(request(0, 1))
    step_ms(s)
    for wave in range(args.waves):
        for i in range(args.burst):
            s.add(request(1 + wave * args.burst + i, 4))
        times = []
        while s.has_work:
            times.append(step_ms(s))
        print(f"wave {wave}: admitting {times[0]:.2f} ms, then " + ", ".join(f"{t:.2f}" for t in times[1:]))


if __name__ == "__main__":
    main()
