"""Skinny GEMM (compiled::linear's Triton kernel) vs torch F.linear (cuBLAS) at decode sizes.

    PYTHONPATH=$PWD python bench/linear_bench.py [--out linear_bench.json] [--m 1 2 4 8 16]
        [--shapes qkv_30b o_30b ...] [--sweep] [--sweep-m 1 16]

Per shape (N, K) and row count M: one CUDA graph of one call per weight copy, over enough
distinct copies (at least 8, and 4x the L2 cache in bytes) that the weights come from HBM, not
L2; median replay time / calls = µs per call. GB/s = (weight + x + y bytes) / time, against the
device copy bandwidth measured here (bytes read + written). `--sweep` also times a small grid of
(BLOCK_N, BLOCK_K, SPLIT_K) at 4 warps / 4 stages, then warps x stages around the best three, and
prints the best per shape next to the heuristic's choice (compiled/linear/skinny_kernels.py);
about 300 tile configs compile over all shapes (minutes): `--shapes` narrows it. `--fused` also
times the kernel with its prologues (compiled/linear/fused.py): the residual add + RMSNorm
in front of the linear (normalised rows kept for the router, as in the MoE layer) and, for the
down projection, SiLU-and-mul, each against the linear alone.

    PYTHONPATH=$PWD python bench/linear_bench.py --fp8 [--fp8-m 1 8 32 64] [--budget-s 20] [--out f.json]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python bench/linear_bench.py --fp8 --device cpu   (smoke run)

`--fp8` sweeps the FP8 linears' tiles instead, on the 30B's dense FP8 shapes (FP8_SHAPES) by
default: the skinny GEMM's GEMV mode and tiles, the W8A16 GEMM (bench/linear_fp8_sweep.py)."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from compiled.linear import skinny_kernels as lk  # noqa: E402
from moe_bench import copy_bandwidth  # noqa: E402
from tune_moe import time_graph  # noqa: E402

# name -> (N, K): Qwen3-30B-A3B (hidden 2048) and Qwen3-0.6B (hidden 1024) decode GEMMs.
SHAPES = {
    "qkv_30b": (5120, 2048),
    "o_30b": (2048, 4096),
    "router_30b": (128, 2048),
    "lm_head_30b": (151936, 2048),
    "qkv_06b": (4096, 1024),
    "o_06b": (1024, 2048),
    "w13_06b": (6144, 1024),
    "down_06b": (1024, 3072),
    "lm_head_06b": (151936, 1024),
}
# The 30B's dense linears with FP8 weights (no dense MLP or shared expert; the LM head and router
# stay bf16); the smoke shapes (CPU) have partial scale blocks.
FP8_SHAPES = ("qkv_30b", "o_30b")
SMOKE_SHAPES = {"smoke_qkv": (80, 320), "smoke_o": (48, 272)}
SMOKE_MAX_CONFIGS = 3
MIN_COPIES = 8
MAX_COPIES = 256
L2_MULTIPLE = 4
SWEEP_BLOCK_N = (16, 32, 64, 128)
SWEEP_BLOCK_K = (64, 128, 256)
SWEEP_SPLIT_K = (1, 2, 4, 8, 16)
SWEEP_WARPS = (4, 8)
SWEEP_STAGES = (3, 4, 5, 6)
DEVICE = "cuda"  # "cpu" only for a smoke run under TRITON_INTERPRET=1 (wall-clock timing)
SWEEP_REFINE = 3
MAX_PROGRAMS_PER_SM = 32   # best configs of the first grid refined over warps x stages


def weight_copies(n: int, k: int) -> int:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) if DEVICE == "cuda" else 0
    return max(MIN_COPIES, min(MAX_COPIES, math.ceil(L2_MULTIPLE * l2 / (n * k * 2))))


def make_weights(n: int, k: int, copies: int) -> list[torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(n * 7 + k)
    return [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16, generator=g) * k ** -0.5 for _ in range(copies)]


def time_calls(fn, x: torch.Tensor, weights: list[torch.Tensor], reps: int) -> float:
    """µs per call: one CUDA graph of one `fn(x, w)` per weight copy."""
    return time_graph([lambda w=w: fn(x, w) for w in weights], reps=reps) / len(weights)


def gbps(m: int, n: int, k: int, us: float) -> float:
    return (n * k + m * k + m * n) * 2 / (us * 1e-6) / 1e9


def check(x: torch.Tensor, w: torch.Tensor, config=None) -> float:
    ref = F.linear(x.float(), w.float())
    out = lk.skinny_linear_triton(x, w, config).float()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def bench_shape(name: str, n: int, k: int, ms: list[int], reps: int, bw: float) -> list[dict]:
    weights = make_weights(n, k, weight_copies(n, k))
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        cfg = lk.skinny_config(m, n, k, lk.num_sms(x.device))
        row = dict(shape=name, n=n, k=k, m=m, copies=len(weights), config=list(cfg), rel_err=check(x, weights[0]))
        row["triton_us"] = time_calls(torch.ops.compiled.linear, x, weights, reps)  # the op: dispatch included
        row["cublas_us"] = time_calls(F.linear, x, weights, reps)
        for key in ("triton", "cublas"):
            row[f"{key}_gbps"] = gbps(m, n, k, row[f"{key}_us"])
            row[f"{key}_frac_copy"] = row[f"{key}_gbps"] * 1e9 / bw
        row["speedup"] = row["cublas_us"] / row["triton_us"]
        print(f"  {name:12s} N={n:6d} K={k:5d} M={m:2d}  triton {row['triton_us']:7.2f} µs "
              f"({row['triton_gbps']:6.0f} GB/s, {100 * row['triton_frac_copy']:3.0f}% copy)  cublas "
              f"{row['cublas_us']:7.2f} µs ({row['cublas_gbps']:6.0f} GB/s)  x{row['speedup']:.2f}  "
              f"cfg {tuple(cfg)} err {row['rel_err']:.1e}", flush=True)
        rows.append(row)
    del weights
    torch.cuda.empty_cache()
    return rows


def bench_fused(name: str, n: int, k: int, ms: list[int], reps: int, steps: int) -> list[dict]:
    """µs per call of the fused op against compiled::linear alone on the same weights."""
    weights = make_weights(n, k, weight_copies(n, k))
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        delta = torch.randn_like(x)
        nw = torch.rand(k, device=DEVICE, dtype=torch.bfloat16) + 0.5
        row = dict(shape=name, n=n, k=k, m=m, linear_us=time_calls(torch.ops.compiled.linear, x, weights, reps))
        keep = name.startswith("router")
        row["add_norm_us"] = time_calls(
            lambda a, w: torch.ops.compiled.add_rms_norm_linear(a, delta, nw, 1e-6, w, keep), x, weights, reps)
        if name.startswith("down"):
            gate_up = torch.randn(m, 2 * k, device=DEVICE, dtype=torch.bfloat16)
            row["silu_us"] = time_calls(torch.ops.compiled.silu_mul_linear, gate_up, weights, reps)
        cfg = tuple(lk.skinny_config(m, n, k, lk.num_sms(x.device), steps))
        print(f"  fused {name:12s} M={m:2d} steps<={steps} {cfg}: " + ", ".join(f"{key} {v:.2f}" for key, v in row.items() if key.endswith("_us")),
              flush=True)
        rows.append(row)
    del weights
    torch.cuda.empty_cache()
    return rows


def valid(cfg: lk.SkinnyConfig, n: int, k: int, num_sms: int) -> bool:
    """Within the workspace, at least one K tile per split, and a grid neither far short of the
    SMs nor so long that the per-program overhead dominates."""
    if cfg.split_k > 1 and (cfg.split_k * n > lk.WORKSPACE_COLS or k // cfg.split_k < cfg.block_k):
        return False
    programs = triton.cdiv(n, cfg.block_n) * cfg.split_k
    if cfg.split_k > 1 and not num_sms // 4 <= programs <= MAX_PROGRAMS_PER_SM * num_sms:
        return False
    return cfg.block_k <= max(16, triton.next_power_of_2(k)) and cfg.block_n <= max(16, triton.next_power_of_2(n))


def try_config(cfg, x, weights, reps: int) -> float | None:
    try:
        if check(x, weights[0], cfg) > 1e-2:
            return None
        return time_calls(lambda a, w: lk.skinny_linear_triton(a, w, cfg), x, weights, reps)
    except Exception as exc:  # noqa: BLE001  (out of shared memory, registers: not a candidate)
        print(f"    {tuple(cfg)}: {type(exc).__name__}", flush=True)
        return None


def sweep_shape(name: str, n: int, k: int, ms: list[int], reps: int) -> list[dict]:
    weights = make_weights(n, k, weight_copies(n, k))
    grid = [lk.SkinnyConfig(bn, bk, s) for bn, bk, s in itertools.product(SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_SPLIT_K)]
    grid = [c for c in grid if valid(c, n, k, lk.num_sms(weights[0].device))]
    out = []
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        heuristic = lk.skinny_config(m, n, k, lk.num_sms(x.device))
        times = {c: try_config(c, x, weights, reps) for c in grid}
        # Warps and stages around the best tiles (the first grid runs at 4 warps, 4 stages).
        ranked = sorted((t, c) for c, t in times.items() if t is not None)
        for _, c in ranked[:SWEEP_REFINE]:
            for w, s in itertools.product(SWEEP_WARPS, SWEEP_STAGES):
                cand = c._replace(num_warps=w, num_stages=s)
                if cand not in times:
                    times[cand] = try_config(cand, x, weights, reps)
        ranked = sorted((t, c) for c, t in times.items() if t is not None)
        heuristic_us = times.get(heuristic) or try_config(heuristic, x, weights, reps)
        if not ranked or heuristic_us is None:
            print(f"  sweep {name} M={m}: no working config (heuristic: {heuristic_us})", flush=True)
            continue
        best_us, best = ranked[0]
        cublas_us = time_calls(F.linear, x, weights, reps)
        print(f"  sweep {name:12s} M={m:2d}: best {tuple(best)} {best_us:.2f} µs ({gbps(m, n, k, best_us):.0f} GB/s); "
              f"heuristic {tuple(heuristic)} {heuristic_us:.2f} µs; cublas {cublas_us:.2f} µs; "
              f"top 5 {[(tuple(c), round(t, 2)) for t, c in ranked[:5]]}", flush=True)
        out.append(dict(shape=name, n=n, k=k, m=m, best=list(best), best_us=best_us, heuristic=list(heuristic),
                        heuristic_us=heuristic_us, cublas_us=cublas_us,
                        all=[[list(c), t] for t, c in ranked]))
    del weights
    torch.cuda.empty_cache()
    return out


def table(rows: list[dict]) -> str:
    lines = ["| shape | N | K | M | triton µs | GB/s | % copy | cuBLAS µs | GB/s | speedup |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['n']} | {r['k']} | {r['m']} | {r['triton_us']:.2f} | "
                     f"{r['triton_gbps']:.0f} | {100 * r['triton_frac_copy']:.0f} | {r['cublas_us']:.2f} | "
                     f"{r['cublas_gbps']:.0f} | {r['speedup']:.2f} |")
    return "\n".join(lines)


def main_fp8(args) -> None:
    """The FP8 sweep (`linear_fp8_sweep`), its rows written to args.out after each (shape, M)."""
    import tune_moe
    from linear_fp8_sweep import run_sweep, table
    from compiled.triton_utils import interpreting
    if args.device == "cpu" and not interpreting():
        sys.exit("--device cpu: run under TRITON_INTERPRET=1")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("linear_bench.py --fp8 needs a CUDA device (or --device cpu under TRITON_INTERPRET=1)")
    tune_moe.DEVICE = args.device   # its time_graph: CUDA graphs, or wall-clock on CPU
    shapes = SMOKE_SHAPES if args.device == "cpu" else {name: SHAPES[name] for name in args.shapes or FP8_SHAPES}
    max_configs = args.max_configs or (SMOKE_MAX_CONFIGS if args.device == "cpu" else None)
    info = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter: smoke run)",
                torch=torch.__version__, triton=triton.__version__, date=time.strftime("%Y-%m-%d"),
                command=" ".join(sys.argv), num_sms=lk.num_sms(torch.device(args.device)), budget_s=args.budget_s)
    print(f"{info['device']}; torch {info['torch']}; triton {info['triton']}; {info['num_sms']} SMs", flush=True)
    torch.manual_seed(0)

    def emit(rows: list[dict]) -> None:
        Path(args.out).write_text(json.dumps(dict(info=info, fp8=rows), indent=1) + "\n")
    rows = run_sweep(shapes, args.fp8_m, args.reps, args.budget_s, max_configs, args.device, emit)
    print(table(rows), flush=True)
    print(f"wrote {args.out}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    p.add_argument("--shapes", nargs="*", default=None, choices=list(SHAPES),
                   help="default: every shape; with --fp8, FP8_SHAPES")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also search (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)")
    p.add_argument("--sweep-m", type=int, nargs="*", default=[1, 16])
    p.add_argument("--fused", action="store_true", help="also time the add + RMSNorm and SiLU prologues")
    p.add_argument("--prologue-steps", type=int, nargs="*", default=[lk.PROLOGUE_MAX_STEPS],
                   help="--fused: time each of these K-step bounds (linear_kernels.PROLOGUE_MAX_STEPS)")
    p.add_argument("--fp8", action="store_true", help="sweep the FP8 linears' tiles instead (linear_fp8_sweep.py)")
    p.add_argument("--fp8-m", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256], help="--fp8: row counts")
    p.add_argument("--budget-s", type=float, default=20.0, help="--fp8: sweep time per shape and row count")
    p.add_argument("--max-configs", type=int, default=None,
                   help=f"--fp8: configs a pass at most (default: all; {SMOKE_MAX_CONFIGS} on CPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="--fp8: cpu is a smoke run of the script under TRITON_INTERPRET=1 (small shapes)")
    p.add_argument("--out", default="linear_bench.json")
    args = p.parse_args(argv)
    if args.fp8:
        return main_fp8(args)
    if args.device != "cuda":
        sys.exit("--device cpu: only the --fp8 sweep has a CPU smoke run")
    args.shapes = args.shapes or list(SHAPES)
    if not torch.cuda.is_available():
        sys.exit("linear_bench.py needs a CUDA device")
    if max(args.m + args.sweep_m) > lk.SKINNY_MAX_M:
        sys.exit(f"--m / --sweep-m: the kernel serves at most {lk.SKINNY_MAX_M} rows")
    import triton
    torch.manual_seed(0)
    bw = copy_bandwidth()
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv), copy_bytes_per_s=bw,
                num_sms=lk.num_sms(torch.device("cuda", torch.cuda.current_device())))
    print(f"{info['device']}; torch {info['torch']}; triton {info['triton']}; {info['num_sms']} SMs; "
          f"copy {bw / 1e12:.2f} TB/s (read+write)", flush=True)
    result = dict(info=info, rows=[], sweep=[], fused=[])
    for name in args.shapes:
        result["rows"] += bench_shape(name, *SHAPES[name], args.m, args.reps, bw)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result["rows"]), flush=True)
    if args.fused:
        for steps in args.prologue_steps:
            lk.PROLOGUE_MAX_STEPS = steps   # read by the kernels' launcher
            for name in args.shapes:
                result["fused"] += [dict(r, prologue_steps=steps) for r in bench_fused(name, *SHAPES[name], args.m,
                                                                                         args.reps, steps)]
                Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.sweep:
        for name in args.shapes:
            result["sweep"] += sweep_shape(name, *SHAPES[name], args.sweep_m, args.reps)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
