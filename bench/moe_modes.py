"""The fused MoE's grouped GEMMs at one token count in each mode, side by side.

Over bf16 experts, and over FP8 experts W8A16 and W8A8 (the modes `fused_moe.W8A8_MIN_TOKENS`
chooses between): each GEMM's best of one fixed list of tiles, µs a layer (`tune_moe.Problem`'s
timing: a CUDA graph of one launch a layer over 4 layers' weights; the tiles compiled first by
`tune_moe.precompile`'s workers). `--tree` times another checkout's kernels, so that two commits'
GEMMs compare on one machine.

    PYTHONPATH=$PWD python bench/moe_modes.py [--tokens 2048] [--modes w8a8,w8a16,bf16] [--tree DIR]

Tiles: 64 rows (BLOCK_N 128, BLOCK_K 64 and 128, 4 and 8 warps, 3 and 4 stages, whole and
quarter-height tiles) and 128 rows (8 warps), pointer loads; those that do not fit are left out."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

E, H, I, TOP_K, LAYERS = 128, 2048, 768, 8, 4   # Qwen3-30B-A3B's experts


def tiles(down: bool) -> list[dict]:
    out = [dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=bk, GROUP_SIZE_M=8, num_warps=w, num_stages=st,
                HALF_M=half, TMA=0)
           for bk, w, st, half in itertools.product((64, 128), (4, 8), (3, 4), (0, 2))]
    out += [dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=st,
                 HALF_M=0, TMA=0)
            for bn, st in itertools.product((128, 256) if down else (64, 128), (3, 4))]
    return out


def mode_of(tm, name: str):
    return tm.Mode() if name == "bf16" else tm.Mode(True, name == "w8a8", 128, 128)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--modes", default="w8a8,w8a16,bf16")
    p.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent),
                   help="the checkout whose kernels are timed")
    args = p.parse_args(argv)
    tree = Path(args.tree).resolve()
    sys.path[:0] = [str(tree), str(tree / "bench")]
    import torch
    import tune_moe as tm
    if not torch.cuda.is_available():
        sys.exit("moe_modes.py needs a CUDA device")
    modes = args.modes.split(",")
    for name in modes:
        jobs = [("down" if d else "up", mode_of(tm, name), tuple(sorted(c.items()))) for d in (0, 1) for c in tiles(d)]
        tm.precompile(jobs, E, H, I, TOP_K, "bfloat16", 12, None if name == "bf16" else (128, 128))
    fp8 = tm.make_fp8_weights(LAYERS, E, H, I)
    bf16 = tm.make_weights(LAYERS, E, H, I, torch.bfloat16)
    results = {}
    for name in modes:
        if name == "bf16":
            prob = tm.Problem(*bf16, args.tokens, TOP_K, E)
        else:
            w13, w2, scales = fp8
            prob = tm.Problem(w13, w2, args.tokens, TOP_K, E, scales=scales, mode=mode_of(tm, name))
        for down in (False, True):   # tiles that do not fit are named and left out
            key = f"{name} {'down' if down else 'gate/up'}"
            best = tm._best_tile(prob, args.tokens, tiles(down), down)
            if best is None:
                sys.exit(f"moe_modes.py: no tile of {key} ran")
            us, cfg = best
            results[key] = (round(us, 1), cfg)
            print(f"{key}: {us:.1f} us {cfg}", flush=True)
    print(json.dumps(dict(tokens=args.tokens, tree=str(tree), results=results)))
    return results


if __name__ == "__main__":
    main()
