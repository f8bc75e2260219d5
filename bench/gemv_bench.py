"""The skinny GEMM's GEMV mode (weight tiles straight into registers, FMA, one reduction at the
end; no tensor-core tile, no shared-memory staging) against its tensor-core tiles and cuBLAS on
the decode step's linears, at one row (where the heuristic takes it) and, with --rows, at more
(where the heuristic's GEMV_MAX_M would have to be raised first): the `gemv_config` tile and
the best of a sweep. Timing as bench/linear_bench.py (one CUDA graph of one call per weight
copy, copies cycled past L2).

    python bench/gemv_bench.py [--shapes qkv_30b o_30b ...] [--rows 1,2,4,8] [--budget-s 40] [--out r.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from bench.linear_bench import SHAPES, make_weights, time_calls, try_config, weight_copies
from compiled.linear import skinny_kernels as lk

GRID = list(itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048), (1, 2, 4, 8, 16), (4, 8), (1,)))


def candidates(m: int, n: int, k: int, sms: int) -> list[tuple]:
    out = []
    for bn, bk, s, w, st in GRID:
        regs = triton.next_power_of_2(m) * bn * bk // (32 * w)   # fp32 accumulator per thread
        programs = triton.cdiv(n, bn) * s
        if regs > 128 or k // s < bk or s * n > lk.WORKSPACE_COLS or not sms // 2 <= programs <= 64 * sms:
            continue
        out.append(lk.SkinnyConfig(bn, bk, s, w, st, gemv=True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["qkv_30b", "o_30b", "router_30b", "qkv_06b", "o_06b",
                                                    "w13_06b", "down_06b"])
    ap.add_argument("--rows", default="1", help="comma-separated row counts (M)")
    ap.add_argument("--budget-s", type=float, default=40.0, help="sweep time per shape and row count")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    sms = lk.num_sms(dev)
    record = {"device": torch.cuda.get_device_name(), "shapes": {}}
    for name, m in itertools.product(a.shapes, [int(r) for r in a.rows.split(",")]):
        n, k = SHAPES[name]
        weights = make_weights(n, k, weight_copies(n, k))
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        tiles, gemv = lk.skinny_config(max(m, 2), n, k, sms), lk.gemv_config(n, k, sms)
        row = {"m": m, "cublas_us": time_calls(F.linear, x, weights, a.reps),
               "tiles_us": time_calls(lambda a_, w: lk.skinny_linear_triton(a_, w, tiles), x, weights, a.reps),
               "gemv_heuristic": list(gemv),
               "gemv_us": time_calls(lambda a_, w: lk.skinny_linear_triton(a_, w, gemv), x, weights, a.reps)}
        timed, start = [], time.perf_counter()
        for cfg in candidates(m, n, k, sms):
            if time.perf_counter() - start > a.budget_s:
                break
            us = try_config(cfg, x, weights, a.reps)   # None: wrong result or not compilable
            if us is not None:
                timed.append((us, cfg))
        timed.sort()
        row["sweep_best"] = [(round(t, 2), list(c)) for t, c in timed[:5]]
        row["tried"] = len(timed)
        record["shapes"][f"{name} M={m}"] = row
        print(f"{name:10s} N={n} K={k} M={m}: cuBLAS {row['cublas_us']:.2f} µs, tiles {row['tiles_us']:.2f}, "
              f"GEMV {row['gemv_us']:.2f} {tuple(gemv)[:4]}, sweep {row['sweep_best'][:3]} ({len(timed)} tried)",
              flush=True)
        del weights
        torch.cuda.empty_cache()
    if a.out is not None:
        a.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
