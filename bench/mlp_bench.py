"""A dense MLP per layer at decode sizes: the one-launch kernel (`compiled/graphs/mlp_kernel.py`)
against the unfused ops the graph runs without it (add + RMSNorm, cuBLAS's gate/up, the down
GEMM with SiLU-and-mul in its prologue). A chain of `--layers` MLPs, each with its own weights
(so they stream from memory, as in a step), is captured in one CUDA graph and replayed; µs per
layer, median of the replays. `--sweep` times every tile in SWEEP for the fused kernel.

    python bench/mlp_bench.py [--hidden 1024 --inter 3072 --layers 28 --rows 1,8] [--sweep] [--out r.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from compiled.graphs import fused_linear as fl
from compiled.graphs.mlp_kernel import DEFAULT_CONFIG, MLPConfig, mlp_triton

SWEEP = [MLPConfig(bi, bk, bn, w, s) for bi, bk, bn, w, s in itertools.product(
    (16, 32, 64), (64, 128, 256), (128, 256), (4, 8), (3, 4))]


def chain_us(step, layers: list, x: torch.Tensor, d: torch.Tensor, reps: int = 30) -> float:
    """µs per layer of `step(x, d, layer) -> (y, h)` chained over `layers` in one CUDA graph."""
    def run():
        a, b = x, d
        for layer in layers:
            b, a = step(a, b, layer)
        return a
    run()  # compiles and allocates outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(layers))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    dev, dt, K, I, eps = torch.device("cuda"), torch.bfloat16, a.hidden, a.inter, 1e-6
    layers = [(torch.rand(K, device=dev, dtype=dt) + 0.5,
               torch.randn(2 * I, K, device=dev, dtype=dt) / K ** 0.5,
               torch.randn(K, I, device=dev, dtype=dt) / I ** 0.5) for _ in range(a.layers)]
    acc = torch.zeros(16 * K, dtype=torch.int64, device=dev)
    done = torch.zeros(1, dtype=torch.int32, device=dev)

    def unfused(x, d, layer):
        nw, w13, w2 = layer
        gate_up, h, _ = fl.add_rms_norm_linear(x, d, nw, eps, w13, False)
        return fl.silu_mul_linear(gate_up, w2), h

    def fused(config):
        def step(x, d, layer):
            nw, w13, w2 = layer
            return mlp_triton(x, d, nw, eps, w13, w2, acc, done, config)
        return step

    record: dict = {"device": torch.cuda.get_device_name(), "hidden": K, "inter": I, "layers": a.layers, "rows": {}}
    for M in [int(r) for r in a.rows.split(",")]:
        x = torch.randn(M, K, device=dev, dtype=dt)
        d = torch.randn(M, K, device=dev, dtype=dt)
        ref_y, ref_h = unfused(x, d, layers[0])
        y, h = fused(DEFAULT_CONFIG)(x, d, layers[0])
        row = {"max_err_vs_unfused": (y.float() - ref_y.float()).abs().max().item(),
               "h_equal": bool(torch.equal(h, ref_h)),
               "unfused_us": chain_us(unfused, layers, x, d),
               "fused_default_us": chain_us(fused(DEFAULT_CONFIG), layers, x, d)}
        if a.sweep:
            timed = [(chain_us(fused(c), layers, x, d), c) for c in SWEEP]
            timed.sort(key=lambda t: t[0])
            row["sweep_best"] = [(round(t, 2), list(c)) for t, c in timed[:8]]
        record["rows"][M] = row
        print(f"K={K} I={I} M={M}: unfused {row['unfused_us']:.2f} µs/layer, fused (default) "
              f"{row['fused_default_us']:.2f}, max err {row['max_err_vs_unfused']:.4f}, h equal {row['h_equal']}"
              + (f", best {row['sweep_best'][:3]}" if a.sweep else ""), flush=True)
    if a.out is not None:
        a.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
