"""Triton kernel writing a step's new K and V into the paged pools at `out_cache_loc` (one launch
for both pools; the torch reference is `reference.store_kv`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K, V, K_cache, V_cache, Loc,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(K_cache + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :],
             k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(V_cache + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :],
             v.to(V_cache.dtype.element_ty), mask=mask)


def store_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor) -> None:
    """k/v `[T, kv_heads, head_dim]` (last dim contiguous) -> pools `[slots, kv_heads, head_dim]` at loc `[T]`."""
    t, h, d = k.shape
    if t == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        H=h, D=d, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d),
        num_warps=4 if h * d >= 1024 else 1,
    )
