"""What a decode step costs beyond its graph: the step's device work built up one piece at a time
(graph replays back to back, then with the staging upload, the feed copy of the sampled tokens,
the tokens' read-back), each loop timed by CUDA events and by the host, next to the engine's own
decode step median on the same model and batch.

    python bench/step_overhead.py MODEL --batch 1 [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cli import bench_core as core
from compiled.passes.variant import BASE
from compiled.runtime.config import EngineConfig


def timed(fn, reps: int) -> dict:
    """Per-iteration ms of `fn` queued `reps` times without a sync: GPU (events) and host."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    host = time.perf_counter() - t0
    end.synchronize()
    return {"gpu_ms": start.elapsed_time(end) / reps, "host_ms": 1e3 * host / reps}


def loops(llm, batch: int) -> dict:
    """The decode graph's step, one piece added per loop. The graphs' inputs still hold the last
    decode batch the engine staged (its requests finished; replaying rewrites their freed slots)."""
    runner = llm.engine.runner
    graphs = runner.variants[BASE].decode
    bucket = graphs.bucket_for(batch)
    inputs = graphs.inputs
    readback = llm.engine._readback
    pending: list = []

    def replay():
        graphs.replay(bucket)

    def upload():
        inputs.upload()

    def feed():
        runner._feed(graphs.argmax[:batch], batch, inputs)

    def read_back():
        pending.append(readback.start([None] * batch, graphs.argmax[:batch], []))
        if len(pending) > 1:
            pending.pop(0).tokens()  # the step before this one, as overlap scheduling reads it

    steps = {
        "replay": [replay],
        "upload + replay": [upload, replay],
        "upload + feed + replay": [upload, feed, replay],
        "upload + feed + replay + read-back": [upload, feed, replay, read_back],
    }
    out = {}
    for name, parts in steps.items():
        def step(parts=parts):
            for part in parts:
                part()
        out[name] = timed(step, 300)
        pending.clear()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    args = EngineConfig(model=a.model, load_format="dummy", max_model_len=2048, max_num_seqs=max(a.batch, 8))
    llm, _ = core.startup(args, a.input_len)
    res, _ = core.latency(llm, a.batch, a.input_len, a.output_len, iters=1, warmup=1, seed=0)
    record = {"model": a.model, "batch": a.batch, "environment": core.environment(llm.config.device),
              "engine_decode_step_ms": res["decode_step_ms"], "loops": loops(llm, a.batch)}
    print(f"{a.model} batch {a.batch}: engine decode step p50 {res['decode_step_ms']['p50']:.4f} ms")
    for name, r in record["loops"].items():
        print(f"  {name:40s} GPU {r['gpu_ms']:.4f} ms  host {r['host_ms']:.4f} ms")
    if a.out is not None:
        core.write_json(a.out, record)


if __name__ == "__main__":
    main()
