"""Triton kernel for `compiled::topk_route`: fp32 softmax over all experts, top-k, renormalise.

One launch instead of softmax + topk + sum + div; ROWS tokens per program. Ties pick the lower
expert index. With LOCAL (expert parallelism) it keeps the pairs of experts
[first, first + count), ids made local, and gives the others id -1 (`routing.NOT_LOCAL`) and
weight 0."""

from __future__ import annotations

import triton
import triton.language as tl

from compiled.triton_utils import pdl_wait


@triton.jit
def topk_route_kernel(logits_ptr, weights_ptr, ids_ptr, T, E, stride_t, first, count,
                      TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                      ROWS: tl.constexpr, RENORM: tl.constexpr, LOCAL: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    route_rows(logits_ptr, weights_ptr, ids_ptr, tl.program_id(0) * ROWS, T, E, stride_t, first, count,
               TOP_K, K_PAD, E_PAD, ROWS, RENORM, LOCAL)


@triton.jit
def route_rows(logits_ptr, weights_ptr, ids_ptr, row0, T, E, stride_t, first, count,
               TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
               ROWS: tl.constexpr, RENORM: tl.constexpr, LOCAL: tl.constexpr):
    """Route tokens [row0, min(row0 + ROWS, T)): their top-k weights and ids stored. The
    alignment's count kernel (`fused_moe_kernels`) calls it too where it routes its own chunk."""
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < T
    ok = row_ok[:, None] & (cols[None, :] < E)
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :], mask=ok,
                     other=float("-inf")).to(tl.float32)
    logits = tl.where(row_ok[:, None], logits, 0.0)  # rows past T: finite garbage, never stored
    mx = tl.max(logits, axis=1)
    p = tl.where(ok, tl.exp(logits - mx[:, None]), 0.0)
    denom = tl.sum(p, axis=1)
    probs = p / tl.where(row_ok, denom, 1.0)[:, None]
    probs = tl.where(ok, probs, -1.0)
    slots = tl.arange(0, K_PAD)
    vals = tl.zeros([ROWS, K_PAD], dtype=tl.float32)
    idxs = tl.zeros([ROWS, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        arg = tl.min(tl.where(probs == best[:, None], cols[None, :], E_PAD), axis=1)
        vals = tl.where(slots[None, :] == j, best[:, None], vals)
        idxs = tl.where(slots[None, :] == j, arg[:, None], idxs)
        probs = tl.where(cols[None, :] == arg[:, None], -1.0, probs)
    if RENORM:
        vals = vals / tl.sum(vals, axis=1)[:, None]
    if LOCAL:   # after the renormalisation: the weights stay those of the whole routing
        local = idxs - first
        mine = (local >= 0) & (local < count)
        vals = tl.where(mine, vals, 0.0)
        idxs = tl.where(mine, local, -1)
    out_ok = row_ok[:, None] & (slots[None, :] < TOP_K)
    offs = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + offs, vals, mask=out_ok)
    tl.store(ids_ptr + offs, idxs.to(tl.int64), mask=out_ok)
