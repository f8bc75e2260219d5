"""The router's skinny launch (Qwen3-30B-A3B: N = 128 experts, K = 2,048), with the residual add +
RMSNorm in front (`add_rms_norm_linear_triton`, the router after o_proj) or without (the router
behind a LoRA'd o_proj), swept over its tiles at decode rows:

    PYTHONPATH=$PWD python bench/router_sweep.py [--rows 8 16 32 48 64] [--no-norm]

Per row count: the heuristic's config (`skinny_config`), then every (BLOCK_N, BLOCK_K, SPLIT_K) of
the grid at 4 warps and 5 stages, then warps x stages around the best two. Each config's outputs
are first checked against torch (the normed rows and y); µs a call as `linear_bench.py` times them:
one CUDA graph of a call per router copy, copies cycled past L2 (in a decode step the MoE's
weights have evicted it). Prints the heuristic's time and the fastest six."""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import linear_bench as lb   # bench/ is the script's folder, so on sys.path

from compiled.functional import add_rms_norm_ref
from compiled.linear import skinny_kernels as lk

N, K, EPS = 128, 2048, 1e-6
GRID = ((16, 32), (128, 256), (2, 4, 8, 16))   # BLOCK_N, BLOCK_K, SPLIT_K
REFINE = ((4, 8), (3, 5))                      # warps, stages around the best two
TOL = 2e-2


def reference(x, delta, nw, w):
    _, normed = add_rms_norm_ref(x, delta, nw, EPS)
    return normed.float() @ w.float().T, normed


def timed(cfg: lk.SkinnyConfig, x, delta, nw, weights, norm: bool) -> float | None:
    """µs a call, None where the config fails or its outputs are off."""
    if norm:
        def call(a, w):
            return lk.add_rms_norm_linear_triton(a, delta, nw, EPS, w, True, config=cfg)
    else:
        def call(a, w):
            return lk.skinny_linear_triton(a, w, cfg)
    try:
        out = call(x, weights[0])
        want, normed = reference(x, delta, nw, weights[0])
        y = out[0] if norm else out
        if ((y.float() - want).abs().max() / want.abs().max()).item() > TOL:
            return None
        if norm and (out[2].float() - normed.float()).abs().max().item() > TOL * normed.float().abs().max().item():
            return None
        return lb.time_calls(call, x, weights, 30)
    except Exception as exc:  # noqa: BLE001  (out of shared memory, registers, workspace: not a candidate)
        print(f"    {tuple(cfg)}: {type(exc).__name__}", flush=True)
        return None


def sweep(m: int, norm: bool, weights: list[torch.Tensor]) -> None:
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    delta = torch.randn_like(x)
    nw = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5
    heuristic = lk.skinny_config(m, N, K, lk.num_sms(x.device), lk.PROLOGUE_MAX_STEPS if norm else 0)
    start = time.time()
    times = {heuristic: timed(heuristic, x, delta, nw, weights, norm)}
    for bn, bk, split in itertools.product(*GRID):
        cfg = lk.SkinnyConfig(bn, bk, split)
        if K // split >= bk and cfg not in times:
            times[cfg] = timed(cfg, x, delta, nw, weights, norm)
    for _, best in sorted((t, c) for c, t in times.items() if t is not None)[:2]:
        for warps, stages in itertools.product(*REFINE):
            cfg = best._replace(num_warps=warps, num_stages=stages)
            if cfg not in times:
                times[cfg] = timed(cfg, x, delta, nw, weights, norm)
    ranked = sorted((t, c) for c, t in times.items() if t is not None)
    label = "with its norm" if norm else "alone"
    h = times[heuristic]
    print(f"M={m} {label} ({time.time() - start:.0f} s): heuristic {tuple(heuristic)} "
          f"{'failed' if h is None else f'{h:.2f} µs'}; fastest {[(tuple(c), round(t, 2)) for t, c in ranked[:6]]}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", default=[8, 16, 32, 48, 64])
    ap.add_argument("--no-norm", action="store_true", help="the router alone (no add + RMSNorm in front)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("router_sweep.py needs a CUDA device")
    torch.manual_seed(0)
    weights = lb.make_weights(N, K, lb.weight_copies(N, K))
    for m in a.rows:
        sweep(m, not a.no_norm, weights)


if __name__ == "__main__":
    main()
