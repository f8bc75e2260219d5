"""Decode attention tiles at a short context: µs a call of each (KV tokens a tile, warps, pipeline
stages) at batch 64 / 8 / 1, with the split count the heuristic gives (and 2 where it gives 1), over
`attention_bench.DecodeBench` (CUDA graph replays of calls on different requests' K/V, a pool of
512 requests: beyond L2). Needs CUDA.

    python bench/decode_tile_sweep.py [--ctx 528] [--batches 64,8,1]

528 tokens is the middle of `e2e_suite.py`'s decode contexts (512-token prompts, 32 steps)."""

from __future__ import annotations

import argparse

from attention_bench import DecodeBench

from compiled.attention.triton_decode import PROGRAMS_PER_SM

CONFIGS = [(128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3),
           (64, 2, 3), (32, 4, 4), (32, 2, 4), (256, 8, 2)]


def sweep(bench: DecodeBench, batch: int, ctx: int) -> list[tuple]:
    """(µs, block_n, warps, stages, splits) per config, fastest first; a config that cannot run
    gives its error in place of the split count."""
    rows = []
    unsplit = bench.workspace(PROGRAMS_PER_SM).splits_for(batch) == 1
    for block_n, warps, stages in CONFIGS:
        for splits in ((None, 2) if unsplit else (None,)):
            try:
                r = bench.run(batch, ctx, splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
                rows.append((round(r["us"], 2), block_n, warps, stages, r["splits"]))
            except Exception as e:  # noqa: BLE001 - a config the workspace or the GPU refuses
                rows.append((float("inf"), block_n, warps, stages, str(e)[:60]))
    return sorted(rows, key=lambda row: row[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=528)
    ap.add_argument("--batches", default="64,8,1")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    bench = DecodeBench(512, args.ctx + 16, min_rows=2 * max(batches))   # room for the largest split 2 ways
    for batch in batches:
        for row in sweep(bench, batch, args.ctx):
            print(batch, row, flush=True)


if __name__ == "__main__":
    main()
