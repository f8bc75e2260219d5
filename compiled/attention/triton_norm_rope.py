"""Qwen3's per-head RMSNorm and RoPE on the raw q/k projection output, inside the attention launch.

`norm_rope_tile` is the shared piece: the decode kernel applies it to the query heads it loads and
to the step's new K before storing it, so a decode step spends no launches on norms or rotation.
The extend path runs `norm_rope_store_triton`: one program per token normalises and rotates every
q and k head, writes them out for the extend kernel and stores K/V into the pools (the launch
that `store_kv_triton` makes otherwise). The torch reference is `reference.norm_rope_ref`.

The rounding follows the model's (HF's) order of operations in the tensors' dtype: the normalised
value before and after the weight, cos/sin from the fp32 table, each RoPE product and their sum,
so bf16 results match the unfused graph up to the sum of squares' order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiled.attention.reference import NormRope


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def norm_rope_tile(X, row_offs, mask_rows, offs_d, W, Cos_sin_row, eps, D: tl.constexpr, DTYPE: tl.constexpr):
    """Rows `X + row_offs[r] + [0, D)` -> RMSNorm (weight W `[D]`) then neox RoPE with the table
    row at `Cos_sin_row` (cos of the D/2 frequencies, then their sin). Returns an fp32 tile of
    values already rounded to DTYPE; masked rows and columns are zero."""
    HALF: tl.constexpr = D // 2
    mask_d = offs_d < D
    first = offs_d < HALF
    rot_d = tl.where(first, offs_d + HALF, offs_d - HALF)   # rotate_half's source column
    freq = tl.where(first, offs_d, offs_d - HALF)
    mask = mask_rows[:, None] & mask_d[None, :]
    x = tl.load(X + row_offs[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xr = tl.load(X + row_offs[:, None] + rot_d[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
    # the weights and the table row loaded as tiles of x's shape (row stride 0): Triton lays them
    # out as x, so their products with x need no layout conversion (each a round trip through
    # shared memory; vectors broadcast after the load needed one each)
    zero = tl.zeros_like(row_offs)[:, None]
    w = tl.load(W + zero + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    wr = tl.load(W + zero + rot_d[None, :], mask=mask, other=0.0).to(tl.float32)
    n = _round(w * _round(x * inv, DTYPE), DTYPE)
    nr = _round(wr * _round(xr * inv, DTYPE), DTYPE)
    cos = _round(tl.load(Cos_sin_row + zero + freq[None, :], mask=mask, other=0.0), DTYPE)
    sin = _round(tl.load(Cos_sin_row + HALF + zero + freq[None, :], mask=mask, other=0.0), DTYPE)
    rotated = _round(nr * sin, DTYPE)
    return _round(_round(n * cos, DTYPE) + tl.where(first[None, :], -rotated, rotated), DTYPE)


@triton.jit(do_not_specialize=["First"])
def _norm_rope_store_kernel(
    Q, K, V, Q_out, K_out, K_cache, V_cache, Loc, Qw, Kw, Pos, Cos_sin, eps, First,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr, HAS_Q: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) + First
    pos = tl.load(Pos + t).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    row = Cos_sin + pos * stride_cs
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    dtype = K.dtype.element_ty
    if HAS_Q:
        hq = tl.arange(0, BLOCK_HQ)
        q = norm_rope_tile(Q + t * stride_qt, hq * stride_qh, hq < HQ, offs_d, Qw, row, eps, D, dtype)
        tl.store(Q_out + t * HQ * D + hq[:, None] * D + offs_d[None, :], q.to(dtype),
                 mask=(hq[:, None] < HQ) & mask_d[None, :])
    hk = tl.arange(0, BLOCK_HKV)
    mask_k = (hk[:, None] < HKV) & mask_d[None, :]
    k = norm_rope_tile(K + t * stride_kt, hk * stride_kh, hk < HKV, offs_d, Kw, row, eps, D, dtype)
    tl.store(K_out + t * HKV * D + hk[:, None] * D + offs_d[None, :], k.to(dtype), mask=mask_k)
    tl.store(K_cache + slot * stride_kcs + hk[:, None] * stride_kch + offs_d[None, :],
             k.to(K_cache.dtype.element_ty), mask=mask_k)
    v = tl.load(V + t * stride_vt + hk[:, None] * stride_vh + offs_d[None, :], mask=mask_k)
    tl.store(V_cache + slot * stride_vcs + hk[:, None] * stride_vch + offs_d[None, :],
             v.to(V_cache.dtype.element_ty), mask=mask_k)


def norm_rope_store_triton(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, loc: torch.Tensor, rope: NormRope,
                           first: int = 0) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Raw q `[T, Hq, D]`, k/v `[T, Hkv, D]` (last dim contiguous) -> normalised and rotated q and
    k (new contiguous tensors), with k and v stored into the pools at `loc` `[T]`. q may be None
    (a context-parallel step's every-rank K/V): k alone, and None for q. `first`: only rows
    first.. (the others are left unwritten and unstored); an offset rather than slices, whose
    int64 arrays would start unaligned and compile the kernel again."""
    t, hkv, d = k.shape
    hq = 1 if q is None else q.shape[1]
    q_out = None if q is None else torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if t <= first:
        return q_out, k_out
    q_in = k if q is None else q
    for x in (q_in, k, v, k_cache, v_cache, rope.cos_sin):
        assert x.stride(-1) == 1
    block_d = triton.next_power_of_2(d)
    _norm_rope_store_kernel[(t - first,)](
        q_in, k, v, k_out if q_out is None else q_out, k_out, k_cache, v_cache, loc, rope.q_weight, rope.k_weight,
        rope.positions, rope.cos_sin, rope.eps, first,
        q_in.stride(0), q_in.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), rope.cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HQ=hq, HKV=hkv, D=d, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HKV=triton.next_power_of_2(hkv),
        BLOCK_D=block_d, HAS_Q=q is not None, num_warps=4 if hq * block_d >= 2048 else 2,
    )
    return q_out, k_out
