"""The FP8 dense linears' tiles, swept (run by `bench/linear_bench.py --fp8`).

Block 128 x 128 FP8 weights (random float8_e4m3fn values, random fp32 scales), x in bf16. Per
shape and row count M, the kernel the op runs there (`compiled/linear/fp8.py`): the skinny GEMM's
GEMV mode at M <= GEMV_MAX_M (columns a program, K step, split, warps), its tensor-core tiles up to
SKINNY_MAX_M, the W8A16 GEMM above (BLOCK_N, BLOCK_K, split K; then warps x stages and BLOCK_M
around the best three). The heuristic's pick is timed first, then the grid nearest to it first,
within a time budget per (shape, M): compiling dominates, and with M outermost the second shape
reuses the first one's compiled kernels. Beside them, cuBLAS on the dequantized bf16 weight (what
a step without the FP8 kernels would run) and, on Hopper, cuBLAS's W8A8 (`fp8_cublas`, what the op
runs past W8A16_MAX_M rows) at the same rows. From 2 to MAX_BLOCK_M rows also the W8A8 configs with
the dots swapped (`W8A16Config.swap`); up to SHORT_TILE_M rows timed with x quantized before the
calls, as the op runs them where the kernel in front quantizes x (the qkv after the MoE's norm),
past it quantizing x in each call. Timing as linear_bench.py: one CUDA graph of one call per weight
copy, copies cycled past L2; each config's output is first checked against F.linear over the
dequantized weight. GB/s counts the FP8 bytes (weight, scales, x, y).

`--device cpu` (under TRITON_INTERPRET=1, small shapes, a few configs, wall-clock timing) is a
smoke run of the script itself: its times mean nothing."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from compiled.linear import SKINNY_MAX_M
from compiled.linear import fp8_cublas
from compiled.linear import fp8_kernels as fk
from compiled.linear import skinny_kernels as lk
from compiled.quant.act_quant import (QuantizedRows, dequantize_per_token_group, quantize_per_token_group,
                                      quantize_per_token_group_ref)
from compiled.quant.dequant import FP8, WeightScale, dequantize_blocks
from compiled.triton_utils import fp8_dot_fits, hopper, hopper_or_newer
from tune_moe import time_graph

BLOCK = [128, 128]
# (block_n, block_k, split_k) grids of the first pass; warps (and stages) refined around the best
GEMV_GRID = ((1, 2, 4, 8), (256, 512, 1024, 2048), (1, 2))
GEMV_WARPS = (2, 4, 8)
# The GEMV mode at several rows (an fp32 accumulator [rows, BLOCK_N, BLOCK_K] in registers): its
# grid at the skinny sizes, tiles whose accumulator fits ROWS_GEMV_MAX_REGS registers a thread.
ROWS_GEMV_GRID = ((1, 2, 4, 8), (64, 128, 256, 512), (1, 2, 4), (1, 2, 4, 8))
ROWS_GEMV_MAX_REGS = 64
ROWS_GEMV_START = lk.SkinnyConfig(4, 128, 1, 4, 1, gemv=True)
TILE_GRID = ((16, 32, 64), (64, 128, 256), (1, 2, 4, 8))
TILE_WARPS = (4, 8)
TILE_STAGES = (3, 4, 5)
A8_GRID = ((16, 32, 64, 128), (64, 128), (1, 2, 4, 8))
A8_START = fk.W8A16Config(16, 64, 128, 2, a8=True)   # the W8A8 configs are timed nearest to it first
SWAP_GRID = ((64, 128), (1, 2, 4, 8))   # (block_n, split_k) of the swapped W8A8 configs, 128-long K steps
REFINE = 3
MIN_COPIES, MAX_COPIES, L2_MULTIPLE = 8, 128, 4
MAX_PROGRAMS_PER_SM = 32
GEMV_MAX_PROGRAMS_PER_SM = 64   # lighter programs (bench/gemv_bench.py's bound)
TOL = 1e-2   # bf16 output against the fp32 reference, relative to its largest value


@dataclass
class Case:
    """One (shape, M): the weight copies, x and the reference output."""
    name: str
    n: int
    k: int
    m: int
    kind: str                               # "gemv", "skinny" or "w8a16": the kernel the op runs at m rows
    weights: list[tuple[torch.Tensor, torch.Tensor]]
    bf16: list[torch.Tensor]                # the same weights dequantized (for cuBLAS)
    x: torch.Tensor
    ref: torch.Tensor
    ref_a8: torch.Tensor                    # with x quantized per token and block (the W8A8 configs' oracle)


def kernel_kind(m: int) -> str:
    return "gemv" if m <= lk.GEMV_MAX_M else "skinny" if m <= SKINNY_MAX_M else "w8a16"


def fp8_weights(n: int, k: int, copies: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(n * 7 + k)
    sn, sk = triton.cdiv(n, BLOCK[0]), triton.cdiv(k, BLOCK[1])
    return [((torch.randn(n, k, device=device, generator=g) * 64).clamp(-448, 448).to(FP8),
             (torch.rand(sn, sk, device=device, generator=g) + 0.5) / (64 * k ** 0.5)) for _ in range(copies)]


def copies_for(n: int, k: int, device: str) -> int:
    if device != "cuda":
        return 2
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(MIN_COPIES, min(MAX_COPIES, math.ceil(L2_MULTIPLE * l2 / (n * k))))


def heuristic(case: Case, sms: int):
    if case.kind == "w8a16":
        return fk.w8a16_config(case.m, case.n, case.k, sms, BLOCK[1], hopper_or_newer(case.x.device))
    return lk.skinny_config(case.m, case.n, case.k, sms, weight_bytes=1)


def call(case: Case, cfg):
    # past SHORT_TILE_M rows the op quantizes x itself (the 30B's o_proj): so do the timed calls
    if isinstance(cfg, fk.W8A16Config) and cfg.swap and case.m <= fk.SHORT_TILE_M:
        pre = QuantizedRows(*quantize_per_token_group(case.x, BLOCK[1]), BLOCK[1])
        return lambda x, w: fk.w8a16_linear(x, w[0], w[1], BLOCK, cfg, quantized=pre)
    if isinstance(cfg, fk.W8A16Config):
        return lambda x, w: fk.w8a16_linear(x, w[0], w[1], BLOCK, cfg)
    return lambda x, w: lk.skinny_linear_triton(x, w[0], cfg, fp8=WeightScale(w[1], BLOCK))


def fits(case: Case, cfg, sms: int, on_gpu: bool) -> bool:
    """A split at least one K tile long, within the workspace; on the GPU a grid neither far short
    of the SMs nor so long that the per-program overhead dominates."""
    if isinstance(cfg, fk.W8A16Config):
        programs = triton.cdiv(case.n, cfg.block_n) * triton.cdiv(case.m, cfg.block_m) * cfg.split_k
        if not fk.fits_workspace(cfg.split_k, case.m, case.n, cfg.block_m, cfg.block_n):
            return False
    else:
        programs = triton.cdiv(case.n, cfg.block_n) * cfg.split_k
        if cfg.split_k * case.n > lk.WORKSPACE_COLS:
            return False
    if case.k // cfg.split_k < cfg.block_k or cfg.block_k > max(16, triton.next_power_of_2(case.k)):
        return False
    most = GEMV_MAX_PROGRAMS_PER_SM if getattr(cfg, "gemv", False) else MAX_PROGRAMS_PER_SM
    return not on_gpu or sms // 4 <= programs <= most * sms


def first_grid(case: Case, h) -> list:
    """The first pass at the heuristic's warps and stages (and BLOCK_M), nearest to it first."""
    if case.kind == "gemv":
        grid = [lk.SkinnyConfig(bn, bk, s, h.num_warps, 1, gemv=True) for bn, bk, s in itertools.product(*GEMV_GRID)]
    elif case.kind == "skinny":
        grid = [lk.SkinnyConfig(bn, bk, s, h.num_warps, h.num_stages) for bn, bk, s in itertools.product(*TILE_GRID)]
    else:
        grid = [fk.W8A16Config(h.block_m, bn, bk, s, h.num_warps, h.num_stages)
                for bn, bk, s in itertools.product(*TILE_GRID)]
    rows_gemv = []
    if case.kind == "skinny":
        rows = triton.next_power_of_2(case.m)
        rows_gemv = [lk.SkinnyConfig(bn, bk, s, w, 1, gemv=True) for bn, bk, s, w in itertools.product(*ROWS_GEMV_GRID)
                     if rows * bn * bk <= ROWS_GEMV_MAX_REGS * 32 * w]
    a8 = []
    if case.kind != "gemv":   # W8A8 (x quantized first) on the W8A16 kernel's tiles, beside the op's kernel
        block_m = max(fk.MIN_BLOCK, min(fk.MAX_BLOCK_M, triton.next_power_of_2(case.m)))
        a8 = [fk.W8A16Config(block_m, bn, bk, s, 4, 4, a8=True)
              for bn, bk, s in itertools.product(*A8_GRID) if fp8_dot_fits(bk, BLOCK[1])]
        if 1 < case.m <= fk.MAX_BLOCK_M:
            a8 += [fk.W8A16Config(block_m, bn, BLOCK[1], s, 4, 4, a8=True, swap=True)
                   for bn, s in itertools.product(*SWAP_GRID)]

    def distance(c, to) -> float:
        return sum(abs(math.log2(getattr(c, f) / getattr(to, f))) for f in ("block_n", "block_k", "split_k"))
    # the kinds alternate, each nearest to its start first: a budget cut short still times each
    grid.sort(key=lambda c: distance(c, h))
    a8.sort(key=lambda c: distance(c, A8_START))
    rows_gemv.sort(key=lambda c: distance(c, ROWS_GEMV_START))
    return [c for group in itertools.zip_longest(grid, a8, rows_gemv) for c in group if c is not None]


def refinements(case: Case, c) -> list:
    if getattr(c, "gemv", False):
        return [c._replace(num_warps=w) for w in GEMV_WARPS]
    out = [c._replace(num_warps=w, num_stages=s) for w, s in itertools.product(TILE_WARPS, TILE_STAGES)]
    if isinstance(c, fk.W8A16Config):
        out += [c._replace(block_m=bm) for bm in (16, 32, 64) if bm < c.block_m]
    return out


def time_config(case: Case, cfg, reps: int) -> float | None:
    """µs a call, or None where the config fails (out of resources) or computes wrongly."""
    fn = call(case, cfg)
    try:
        out = fn(case.x, case.weights[0]).float()
        ref = case.ref_a8 if getattr(cfg, "a8", False) else case.ref
        if ((out - ref).abs().max() / ref.abs().max()).item() > TOL:
            print(f"    {tuple(cfg)}: wrong result", flush=True)
            return None
        return time_graph([lambda w=w: fn(case.x, w) for w in case.weights], reps=reps) / len(case.weights)
    except Exception as exc:  # noqa: BLE001  (out of shared memory, registers: not a candidate)
        print(f"    {tuple(cfg)}: {type(exc).__name__}", flush=True)
        return None


def fp8_gbps(case: Case, us: float) -> float:
    scales = triton.cdiv(case.n, BLOCK[0]) * triton.cdiv(case.k, BLOCK[1]) * 4
    return (case.n * case.k + scales + (case.m * case.k + case.m * case.n) * 2) / (us * 1e-6) / 1e9


def sweep_case(case: Case, sms: int, reps: int, budget_s: float, max_configs: int | None, on_gpu: bool) -> dict:
    h = heuristic(case, sms)
    start = time.perf_counter()
    times = {h: time_config(case, h, reps)}

    def run(candidates: list) -> None:
        for c in candidates:
            if time.perf_counter() - start > budget_s:
                return
            if c not in times and fits(case, c, sms, on_gpu):
                times[c] = time_config(case, c, reps)

    grid = [c for c in first_grid(case, h) if fits(case, c, sms, on_gpu)]
    run(grid[:max_configs] if max_configs else grid)
    ranked = sorted((t, tuple(c), c) for c, t in times.items() if t is not None)
    for _, _, c in ranked[:REFINE]:
        run(refinements(case, c)[:max_configs] if max_configs else refinements(case, c))
    ranked = sorted((t, tuple(c), c) for c, t in times.items() if t is not None)
    cublas_us = time_graph([lambda w=w: F.linear(case.x, w) for w in case.bf16], reps=reps) / len(case.bf16)
    w8a8_us = None   # cuBLAS's W8A8 at these rows, the activations' quantization included (Hopper)
    if fp8_cublas.recipe_fits(case.n, case.k, tuple(BLOCK), tuple(case.weights[0][1].shape)) and hopper(case.x.device):
        w8a8_us = time_graph([lambda q=q, s=s: fp8_cublas.w8a8_linear(case.x, q, s) for q, s in case.weights],
                             reps=reps) / len(case.weights)
    row = dict(shape=case.name, n=case.n, k=case.k, m=case.m, kernel=case.kind, copies=len(case.weights),
               heuristic=list(h), heuristic_us=times[h], tried=len(times),
               failed=sum(t is None for t in times.values()), bf16_cublas_us=cublas_us, w8a8_cublas_us=w8a8_us,
               top=[[list(c), t] for t, _, c in ranked[:5]])
    if ranked:
        row.update(best=list(ranked[0][2]), best_us=ranked[0][0], best_gbps=fp8_gbps(case, ranked[0][0]))
    if times[h] is not None:
        row["heuristic_gbps"] = fp8_gbps(case, times[h])
    return row


def describe(row: dict) -> str:
    def us(v):
        return "failed" if v is None else f"{v:.2f} µs"
    best = f"best {tuple(row['best'])} {us(row['best_us'])} ({row['best_gbps']:.0f} GB/s)" if "best" in row else "none"
    return (f"  fp8 {row['shape']:10s} N={row['n']:5d} K={row['k']:5d} M={row['m']:3d} {row['kernel']:6s}: {best}; "
            f"heuristic {tuple(row['heuristic'])} {us(row['heuristic_us'])}; bf16 cuBLAS {us(row['bf16_cublas_us'])}; "
            f"W8A8 cuBLAS {us(row['w8a8_cublas_us'])}; "
            f"{row['tried']} tried, {row['failed']} failed")


def _us_cell(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def table(rows: list[dict]) -> str:
    lines = ["| shape | M | kernel | best config | µs | GB/s (fp8) | heuristic config | µs | bf16 cuBLAS µs | "
             "W8A8 cuBLAS µs |", "|---|---:|---|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        h_us = "failed" if r["heuristic_us"] is None else f"{r['heuristic_us']:.2f}"
        best = (f"{tuple(r['best'])} | {r['best_us']:.2f} | {r['best_gbps']:.0f}" if "best" in r else "none | | ")
        lines.append(f"| {r['shape']} | {r['m']} | {r['kernel']} | {best} | {tuple(r['heuristic'])} | {h_us} | "
                     f"{r['bf16_cublas_us']:.2f} | {_us_cell(r['w8a8_cublas_us'])} |")
    return "\n".join(lines)


def run_sweep(shapes: dict[str, tuple[int, int]], ms: list[int], reps: int, budget_s: float,
              max_configs: int | None, device: str, emit) -> list[dict]:
    """Every (shape, M), M outermost; `emit(rows)` after each (the caller writes its JSON)."""
    sms = lk.num_sms(torch.device(device))
    on_gpu = device == "cuda"
    weights = {name: fp8_weights(n, k, copies_for(n, k, device), device) for name, (n, k) in shapes.items()}
    bf16 = {name: [dequantize_blocks(q, s, BLOCK, torch.bfloat16) for q, s in ws] for name, ws in weights.items()}
    rows: list[dict] = []
    for m, (name, (n, k)) in itertools.product(ms, shapes.items()):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        q, s = weights[name][0]
        wd = dequantize_blocks(q, s, BLOCK, torch.float32)
        ref = F.linear(x.float(), wd)
        ref_a8 = F.linear(dequantize_per_token_group(*quantize_per_token_group_ref(x, BLOCK[1]), BLOCK[1],
                                                     torch.float32), wd)
        case = Case(name, n, k, m, kernel_kind(m), weights[name], bf16[name], x, ref, ref_a8)
        rows.append(sweep_case(case, sms, reps, budget_s, max_configs, on_gpu))
        print(describe(rows[-1]), flush=True)
        emit(rows)
    return rows
