"""Triton kernel for `compiled::linear_add_norm_route` at decode sizes: the attention's output
projection, the residual add, the post-attention RMSNorm, the router linear and the top-k routing
in one launch.

The projection is the skinny GEMM (`linear_kernels.dot_k_range`: BLOCK_N columns a program, K in
SPLIT_K ranges, the last split to arrive finishes the column block). The router is linear in the
normalised row, and RMSNorm's 1 / rms is one factor a row, so each column block's finisher can
already do its share: h = x + y for its columns, their sum of squares, and the router's partial
logits `(h * norm_weight) @ router[:, columns].T` (the skinny kernel's ADD_NORM arithmetic, per
column block instead of per K range). It writes both to a workspace and bumps one more counter;
the last column block to arrive sums the partials in column order (deterministic), scales by
1 / rms, rounds the logits as the router linear's output would be, routes (`topk_softmax`), writes
the normalised rows for the experts, and puts the counter back to 0.

So the router's launch and the routing's go, and nothing else waits for them. The reference is
the three ops it replaces (`linear_route.linear_add_norm_route_ref`)."""

from __future__ import annotations

import triton
import triton.language as tl

from compiled.graphs.linear_kernels import dot_k_range, split_k_sum
from compiled.graphs.prologue_kernels import residual_add, rms_normed
from compiled.moe.routing_kernels import store_topk, topk_softmax
from compiled.pdl import pdl_wait


@triton.jit
def _linear_add_norm_route_kernel(
    A, WO, X, NW, WR, HO, NORMED, TW, TID, Partials, Semaphores, RPart, SqPart,
    M, N, K, E, K_PER_SPLIT, stride_am, stride_wo, stride_xm, stride_wr, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, N_CB: tl.constexpr, ROWS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr,
    K_PAD: tl.constexpr, RENORM: tl.constexpr, NORM_BLOCK: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """A `[M, K]` @ WO `[N, K]`.T, then with the residual X `[M, N]`: HO = X + that, NORMED =
    RMSNorm(HO) * NW, and the top-k of softmax(NORMED @ WR `[E, N]`.T) into TW / TID `[M, TOP_K]`.
    N_CB = cdiv(N, BLOCK_N) column blocks; ROWS: M rounded up to a power of two (the last
    program's tiles); Semaphores[N_CB] counts the finished column blocks."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    pdl_wait(PDL)
    acc = dot_k_range(A, WO, offs_m, offs_n, mask_m, mask_n, k_start, k_end, stride_am, stride_wo,
                      BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, DOT_PRECISION)
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        last = True
        total = acc
    else:
        last, total = split_k_sum(acc, Partials, Semaphores, pid_n, pid_k, offs_m, offs_n, out_mask, M, N, SPLIT_K)
    if last:
        _finish_columns(total, X, NW, WR, HO, RPart, SqPart, offs_m, offs_n, mask_n, out_mask, pid_n, N, E,
                        stride_xm, stride_wr, BLOCK_M, E_PAD, UPCAST, DOT_PRECISION)
        # Every thread's partial stores must precede the release below.
        tl.debug_barrier()
        arrived = tl.atomic_add(Semaphores + N_CB, 1, sem="acq_rel", scope="gpu")
        if arrived == N_CB - 1:
            _finish_rows(HO, NW, NORMED, TW, TID, RPart, SqPart, M, N, E, eps, N_CB, ROWS, BLOCK_M, E_PAD, TOP_K,
                         K_PAD, RENORM, NORM_BLOCK)
            tl.atomic_xchg(Semaphores + N_CB, 0)


@triton.jit
def _finish_columns(total, X, NW, WR, HO, RPart, SqPart, offs_m, offs_n, mask_n, out_mask, pid_n, N, E,
                    stride_xm, stride_wr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, UPCAST: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """A column block's share: h = x + y (y rounded as the projection's output), and into the
    workspace its rows' sums of squares and partial router logits (h * norm weight, rounded as
    the skinny kernel's ADD_NORM prologue rounds it, times the router's columns)."""
    offs_e = tl.arange(0, E_PAD)
    wr = tl.load(WR + offs_e[:, None] * stride_wr + offs_n[None, :], mask=(offs_e < E)[:, None] & mask_n[None, :],
                 other=0.0)
    x = tl.load(X + offs_m[:, None] * stride_xm + offs_n[None, :], mask=out_mask, other=0.0)
    nw = tl.load(NW + offs_n, mask=mask_n, other=0.0)
    h = residual_add(x, total.to(x.dtype))
    tl.store(HO + offs_m[:, None] * N + offs_n[None, :], h, mask=out_mask)
    hf = h.to(tl.float32)
    xn = (hf * nw.to(tl.float32)[None, :]).to(h.dtype)
    if UPCAST:
        xn = xn.to(tl.float32)
        wr = wr.to(tl.float32)
    part = tl.dot(xn, tl.trans(wr), input_precision=DOT_PRECISION)
    tl.store(RPart + pid_n * BLOCK_M * E_PAD + offs_m[:, None] * E_PAD + offs_e[None, :], part)
    tl.store(SqPart + pid_n * BLOCK_M + offs_m, tl.sum(hf * hf, axis=1))


@triton.jit
def _finish_rows(HO, NW, NORMED, TW, TID, RPart, SqPart, M, N, E, eps, N_CB: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                 RENORM: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """The last column block: every row's logits and 1 / rms from the partials, its routing, and
    its normalised row."""
    rows = tl.arange(0, ROWS)
    row_ok = rows < M
    offs_e = tl.arange(0, E_PAD)
    cols = tl.arange(0, NORM_BLOCK)
    h_ptrs = HO + rows[:, None] * N + cols[None, :]
    # The first slice of h is asked for now, so that its round trip overlaps the partials'.
    h = tl.load(h_ptrs, mask=row_ok[:, None] & (cols < N)[None, :], other=0.0, cache_modifier=".cg")
    logits = tl.zeros([ROWS, E_PAD], dtype=tl.float32)
    sq = tl.zeros([ROWS], dtype=tl.float32)
    # Unrolled, so that the partials' loads are all in flight at once; .cg: other programs wrote them.
    for c in tl.static_range(N_CB):
        logits += tl.load(RPart + c * BLOCK_M * E_PAD + rows[:, None] * E_PAD + offs_e[None, :], cache_modifier=".cg")
        sq += tl.load(SqPart + c * BLOCK_M + rows, cache_modifier=".cg")
    rstd = tl.rsqrt(sq / N + eps)
    # the router linear's output is stored in h's dtype before the routing reads it
    logits = (logits * rstd[:, None]).to(h.dtype).to(tl.float32)
    ok = row_ok[:, None] & (offs_e < E)[None, :]
    vals, idxs = topk_softmax(logits, row_ok, ok, offs_e, TOP_K, K_PAD, E_PAD, RENORM)
    store_topk(TW, TID, rows, row_ok, vals, idxs, TOP_K, K_PAD)
    # the normalised rows, one slice ahead of its stores
    for c0 in range(0, N, NORM_BLOCK):
        ks = c0 + cols
        mask = row_ok[:, None] & (ks < N)[None, :]
        nxt = ks + NORM_BLOCK
        h_next = tl.load(h_ptrs + c0 + NORM_BLOCK, mask=row_ok[:, None] & (nxt < N)[None, :], other=0.0,
                         cache_modifier=".cg")
        nw = tl.load(NW + ks, mask=ks < N, other=0.0)
        tl.store(NORMED + rows[:, None] * N + ks[None, :], rms_normed(h, rstd[:, None], nw[None, :]).to(h.dtype),
                 mask=mask)
        h = h_next
