"""A dense MLP for a few rows in one launch (Triton): residual add + RMSNorm, gate/up, SiLU-and-mul
and the down projection, `y = down(silu(gate(n)) * up(n))` with `n = RMSNorm(x + delta)`.

At decode sizes the unfused MLP is three launches in a row (the add + norm, cuBLAS's gate/up, the
down GEMM with SiLU-and-mul in its prologue), each waiting for the one before, and cuBLAS takes no
part in programmatic dependent launch. Here program p owns BLOCK_I intermediate columns: it
streams their gate and up rows (the normalised input built on the fly, as the skinny GEMM's
ADD_NORM prologue builds it), applies SiLU-and-mul, and multiplies at once by the matching
BLOCK_I columns of the down weight, its share of every output column. The shares are summed in
an int64 accumulator in fixed point (units of 2^-32, as the one-token MoE kernel sums:
integer adds in any order give the same total, so the output is the same on every run); the
program that finishes last rounds the sums into y and puts the accumulator and its counter back
to zero, so the kernel is safe to capture in a CUDA graph. Program 0 also stores h = x + delta,
the residual stream's next value.

Rounding: gate/up in fp32 scaled by each row's 1 / rms at the end (the skinny GEMM's ADD_NORM
order), rounded to the activation dtype, SiLU-and-mul rounded as torch rounds it, the down
projection's sums in fixed point, then rounded once. The torch reference is
`compiled.graphs.fused_mlp.add_rms_norm_mlp_ref`. The shares stay below 2^31 in magnitude (far
beyond a 16-bit model's activations)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from compiled.attention.triton_decode import interpreter_upcast
from compiled.graphs.prologue_kernels import residual_add, silu_mul
from compiled.pdl import launch_kwargs, pdl_wait

FIXED_POINT_SCALE = tl.constexpr(4294967296.0)  # 2^32: one unit of the accumulator is 2^-32
FINISH_BLOCK = 2048        # accumulator entries the last program converts per step


class MLPConfig(NamedTuple):
    block_i: int = 32      # intermediate columns per program
    block_k: int = 128     # hidden columns per gate/up step
    block_n: int = 256     # output columns per down step
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_CONFIG = MLPConfig()


@triton.jit
def _mlp_kernel(X, D, NW, W13, W2, H, Y, Acc, Done, M, K, I, eps, stride_xm, stride_dm, stride_w13, stride_w2,
                BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                FINISH: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    pdl_wait(PDL)
    dt = X.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < I
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = W13 + offs_i.to(tl.int64)[None, :] * stride_w13 + offs_k[:, None]
    u_ptrs = g_ptrs + I * stride_w13
    acc_g = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    # The input tiles feed arithmetic before the dot, which Triton's pipeliner does not prefetch:
    # they are loaded one step ahead by hand (as in the skinny GEMM's prologue).
    in_mask = mask_m[:, None] & (offs_k < K)[None, :]
    x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=in_mask, other=0.0)
    d = tl.load(D + offs_m[:, None] * stride_dm + offs_k[None, :], mask=in_mask, other=0.0)
    nw = tl.load(NW + offs_k, mask=offs_k < K, other=0.0)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        nxt = ks + BLOCK_K
        nxt_mask = mask_m[:, None] & (nxt < K)[None, :]
        x_next = tl.load(X + offs_m[:, None] * stride_xm + nxt[None, :], mask=nxt_mask, other=0.0)
        d_next = tl.load(D + offs_m[:, None] * stride_dm + nxt[None, :], mask=nxt_mask, other=0.0)
        nw_next = tl.load(NW + nxt, mask=nxt < K, other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & mask_i[None, :], other=0.0, eviction_policy="evict_first")
        u = tl.load(u_ptrs, mask=k_ok[:, None] & mask_i[None, :], other=0.0, eviction_policy="evict_first")
        h = residual_add(x, d)
        if pid == 0:
            tl.store(H + offs_m[:, None] * K + ks[None, :], h, mask=mask_m[:, None] & k_ok[None, :])
        hf = h.to(tl.float32)
        sq += tl.sum(hf * hf, axis=1)
        a = (hf * nw.to(tl.float32)[None, :]).to(dt)
        if UPCAST:  # see interpreter_upcast()
            a = a.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PRECISION)
        x, d, nw = x_next, d_next, nw_next
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    rstd = tl.rsqrt(sq / K + eps)[:, None]
    act = silu_mul((acc_g * rstd).to(dt), (acc_u * rstd).to(dt))
    act = tl.where(mask_i[None, :], act, 0.0).to(dt)
    offs_n = tl.arange(0, BLOCK_N)
    b_ptrs = W2 + offs_n.to(tl.int64)[None, :] * stride_w2 + offs_i[:, None]
    for n0 in range(0, K, BLOCK_N):
        n_ok = offs_n < K - n0
        b = tl.load(b_ptrs, mask=mask_i[:, None] & n_ok[None, :], other=0.0, eviction_policy="evict_first")
        lhs = act
        if UPCAST:
            lhs = lhs.to(tl.float32)
            b = b.to(tl.float32)
        part = tl.dot(lhs, b, input_precision=DOT_PRECISION)
        tl.atomic_add(Acc + offs_m[:, None] * K + (n0 + offs_n)[None, :], (part * FIXED_POINT_SCALE).to(tl.int64),
                      mask=mask_m[:, None] & n_ok[None, :], sem="relaxed")
        b_ptrs += BLOCK_N * stride_w2
    # Every thread's adds precede the arrival; the last program reads the sums from L2 (.cg).
    tl.debug_barrier()
    if tl.atomic_add(Done, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        offs = tl.arange(0, FINISH)
        for start in range(0, M * K, FINISH):
            idx = start + offs
            ok = idx < M * K
            total = tl.load(Acc + idx, mask=ok, other=0, cache_modifier=".cg")
            tl.store(Y + idx, (total.to(tl.float64) / FIXED_POINT_SCALE).to(tl.float32).to(dt), mask=ok)
            tl.store(Acc + idx, tl.zeros_like(total), mask=ok)
        tl.atomic_xchg(Done, 0)


def mlp_triton(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float, w13: torch.Tensor,
               w2: torch.Tensor, acc: torch.Tensor, done: torch.Tensor,
               config: MLPConfig = DEFAULT_CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) for x, delta `[M, K]` (M <= 16, last dims contiguous), w13 `[2I, K]` = [gate | up],
    w2 `[K, I]`; `acc` (int64, >= M * K) and `done` (int32, >= 1) are zeros, left as zeros."""
    M, K = x.shape
    I = w2.shape[1]
    y, h = x.new_empty((M, K)), x.new_empty((M, K))
    upcast = interpreter_upcast(x.dtype)
    precision = "ieee" if upcast or x.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(I, config.block_i),)
    _mlp_kernel[grid](x, delta, norm_weight, w13, w2, h, y, acc, done, M, K, I, eps, x.stride(0), delta.stride(0),
                      w13.stride(0), w2.stride(0), BLOCK_M=16, BLOCK_I=config.block_i, BLOCK_K=config.block_k,
                      BLOCK_N=config.block_n, FINISH=FINISH_BLOCK, UPCAST=upcast, DOT_PRECISION=precision,
                      num_warps=config.num_warps, num_stages=config.num_stages, **launch_kwargs(x.device))
    return y, h
