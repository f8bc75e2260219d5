"""The expert-LoRA shrinks that run a program a pair or a row (`moe_lora_pair_shrink_kernel`),
Qwen3-30B-A3B's experts (E 128, H 2,048, I 768, top-8) with `--slots` adapters of rank `--rank`:
the gate/up shrink (a program a (token, expert) pair, K = H) over K steps x warps x stages x K
splits, and the down shrink (a program a row of the intermediate in block order, K = I) over K
steps x warps x stages. µs a call: a CUDA graph of one launch a layer over `--layers` copies of
the adapters' A matrices (`tune_moe.time_graph`), each launched by `expert_lora.pair_shrink` with
its `tiles` forced (PDL off). Prints the fastest of each next to the op's own tiles.

    PYTHONPATH=$PWD python bench/shrink_sweep.py [--tokens 8 64]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python bench/shrink_sweep.py --device cpu   (smoke run, tiny shapes)"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import tune_moe  # noqa: E402
from compiled.moe import expert_lora as el  # noqa: E402
from compiled.moe import fused_moe as fm  # noqa: E402
import compiled.moe.routing  # noqa: E402,F401  (registers compiled::topk_route)

SHAPE = dict(E=128, H=2048, I=768, top_k=8)
# (K steps, warps, stages[, K splits]) searched: the gate/up shrink's, the down shrink's
UP_SPACE = list(itertools.product((128, 256, 512), (2, 4, 8), (1, 3), (1, 2, 4, 8)))
DOWN_SPACE = list(itertools.product((128, 256, 1024), (2, 4, 8), (1, 3)))
SMOKE = dict(E=8, H=64, I=32, top_k=2)
SMOKE_UP, SMOKE_DOWN = [(16, 4, 1, 1), (16, 4, 1, 2)], [(16, 4, 1)]


def best(timings: list[tuple[float, str]], current: str, n: int = 6) -> str:
    timings.sort()
    now = [f"{us:.1f}" for us, name in timings if name == current]
    return f"current ({current}) {now[0] if now else 'not run'} µs; best: " + \
        " | ".join(f"{name} {us:.1f}" for us, name in timings[:n])


def sweep(T: int, shape: dict, spaces: tuple[list, list], S: int, R: int, layers: int, device: torch.device,
          reps: int) -> None:
    E, H, I, top_k = shape["E"], shape["H"], shape["I"], shape["top_k"]
    g = torch.Generator(device=device).manual_seed(0)
    a13 = [(torch.randn(S, E, 2 * R, H, device=device, generator=g) / H ** 0.5).bfloat16() for _ in range(layers)]
    a2 = [(torch.randn(S, E, R, I, device=device, generator=g) / I ** 0.5).bfloat16() for _ in range(layers)]
    x = torch.randn(T, H, device=device, generator=g).bfloat16()
    _, ids = torch.ops.compiled.topk_route(torch.randn(T, E, device=device, generator=g), top_k, True)
    slot = torch.randint(0, S, (T,), device=device, generator=g, dtype=torch.int32)
    pairs = T * top_k
    ws, off = fm.MoEWorkspace(), dict(PDL=False)
    out = torch.empty(pairs, 2 * R, device=device)
    blocks = fm.moe_align_block_size(ids, E, 16)
    rows = blocks.expert_ids.numel() * 16
    inter = torch.randn(rows, I, device=device, generator=g).bfloat16()
    out2 = torch.empty(rows, R, device=device)
    up = []
    for bk, warps, stages, split in spaces[0]:
        if H // split < bk:
            continue
        tiles = el.ShrinkTiles(bk, warps, stages, split)
        calls = [lambda i=i: el.pair_shrink(x, a13[i], out, ids, slot, ws, off, tiles=tiles) for i in range(layers)]
        up.append((tune_moe.time_graph(calls, reps) / layers, f"bk{bk} w{warps} s{stages} split{split}"))
    own = el.ShrinkTiles(min(el.PAIR_SHRINK_BLOCK_K, H))
    split = el.pair_shrink_split(pairs, H, own.block_k)
    print(f"{T} tokens, gate/up shrink ({pairs} programs): " +
          best(up, f"bk{own.block_k} w{own.num_warps} s{own.num_stages} split{split}"), flush=True)
    down = []
    for bk, warps, stages in spaces[1]:
        tiles = el.ShrinkTiles(bk, warps, stages, 1)
        calls = [lambda i=i: el.pair_shrink(inter, a2[i], out2, ids, slot, ws, off, blocks, tiles=tiles)
                 for i in range(layers)]
        down.append((tune_moe.time_graph(calls, reps) / layers, f"bk{bk} w{warps} s{stages}"))
    own = el.ShrinkTiles(el.ROW_SHRINK_BLOCK_K)
    print(f"{T} tokens, down shrink ({rows} programs): " +
          best(down, f"bk{own.block_k} w{own.num_warps} s{own.num_stages}"), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="*", default=[8, 64])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=6, help="adapter copies cycled (past L2)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = ap.parse_args()
    tune_moe.DEVICE = a.device
    if a.device == "cuda":
        for T in a.tokens:
            sweep(T, SHAPE, (UP_SPACE, DOWN_SPACE), a.slots, a.rank, a.layers, torch.device("cuda"), a.reps)
    else:
        sweep(3, SMOKE, (SMOKE_UP, SMOKE_DOWN), 2, 4, 1, torch.device("cpu"), 1)


if __name__ == "__main__":
    main()
