"""Time to build on meta, trace and run every pass (checking the graph after each) for a model
shape, on CPU. Usage: python bench/trace_bench.py [CONFIG_DIR] [--repeats 3] [--out FILE.json]"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time

import torch

from compiled.graphs.config import ModelConfig
from compiled.graphs.trace import meta_model, trace
from compiled.passes.manager import run_passes


def once(cfg: ModelConfig) -> tuple[dict, str]:
    t0 = time.perf_counter()
    meta = meta_model(cfg)
    weights = meta.checkpoint_map()
    t1 = time.perf_counter()
    gm = trace(meta)
    t2 = time.perf_counter()
    run_passes(gm, weights)
    t3 = time.perf_counter()
    return {"build": t1 - t0, "trace": t2 - t1, "passes": t3 - t2, "total": t3 - t0}, gm.code


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default="bench/configs/qwen3-30b-a3b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = ModelConfig.from_pretrained(args.config)
    warm_start = time.perf_counter()
    once(dataclasses.replace(cfg, num_hidden_layers=1))  # lazy imports and op registration, paid once
    warm = time.perf_counter() - warm_start
    runs, codes = [], set()
    for _ in range(args.repeats):
        times, code = once(cfg)
        runs.append(times)
        codes.add(code)
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    result = {"config": args.config, "layers": cfg.num_hidden_layers, "cpu": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "first_use_warmup_s": warm,
              "median_s": median, "deterministic": len(codes) == 1}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
