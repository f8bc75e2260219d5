"""The HTTP front end alone: `compiled serve`'s app on the demo model, with the engine's step
replaced by a timed stand-in (in the engine's process, it sleeps --step-ms, then gives every live
request one token). The tokens/s it sends and the inter-token latency a
client sees, against the stand-in's own rate, show what the front end costs at a given
concurrency and whether it keeps up.

    python bench/frontend_bench.py --port 8500 --step-ms 20 &
    python -m cli.main bench serving --url http://127.0.0.1:8500 --num-prompts 192 \\
        --input-len 16 --output-len 200 --max-concurrency 96
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from types import SimpleNamespace

from compiled import LLM
from compiled.server.app import Server, create_app
from compiled.server.engine_process import EngineClient
from compiled.server.listen import listen


class TimedEngine:
    """The real engine for everything but stepping (requests are made and checked as served),
    and a stand-in step: `step_s` of sleep, then one random token for every live request."""

    def __init__(self, engine, step_s: float, seed: int = 0) -> None:
        self._engine, self._step_s = engine, step_s
        self._rng = random.Random(seed)
        self.scheduler = SimpleNamespace(running=[], waiting=[], cache=None)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running)

    def add(self, request) -> None:
        self.scheduler.running.append(request)

    def abort(self, request_id: int) -> bool:
        before = len(self.scheduler.running)
        self.scheduler.running = [r for r in self.scheduler.running if r.id != request_id]
        return len(self.scheduler.running) < before

    def step(self) -> list:
        time.sleep(self._step_s)
        vocab = self._engine.model_config.vocab_size
        finished = []
        for r in self.scheduler.running:
            r.output_token_ids.append(self._rng.randrange(vocab))
            if len(r.output_token_ids) >= r.params.max_new_tokens:
                r.finish_reason = "length"
                finished.append(r)
        self.scheduler.running = [r for r in self.scheduler.running if r.finish_reason is None]
        return finished


def timed_llm(step_s: float) -> LLM:
    """The demo model's LLM with the stand-in step (built in the engine's process)."""
    llm = LLM(device="cpu")
    llm.engine = TimedEngine(llm.engine, step_s)
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8500)
    ap.add_argument("--step-ms", type=float, default=20.0, help="Time of one stand-in step.")
    args = ap.parse_args()
    engine = EngineClient(functools.partial(timed_llm, args.step_ms / 1e3))
    info = engine.start()
    try:
        listen(create_app(Server(engine, info, "demo", None)), "127.0.0.1", args.port)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
