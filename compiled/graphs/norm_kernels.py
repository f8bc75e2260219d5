"""Residual add + RMSNorm (Triton) for the rows the skinny GEMM does not take (prefill, large batches).

`compiled::add_rms_norm_linear` runs this and then F.linear there: one launch, as the Inductor
kernel it replaces was, instead of the seven eager ops of the reference. One row a program, the
whole row in one tile. The torch reference is `fused_linear.add_rms_norm_ref`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(X, D, NW, H, NORMED, K, eps, stride_xm, stride_dm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(X + row * stride_xm + cols, mask=mask, other=0.0)
    d = tl.load(D + row * stride_dm + cols, mask=mask, other=0.0)
    h = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
    tl.store(H + row * K + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / K + eps)
    nw = tl.load(NW + cols, mask=mask, other=0.0).to(tl.float32)
    normed = nw * (hf * rstd).to(x.dtype).to(tl.float32)   # rounded where `layers.rms_norm` rounds
    tl.store(NORMED + row * K + cols, normed.to(x.dtype), mask=mask)


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = x + delta, RMSNorm(h) * norm_weight) for x, delta `[T, K]` (last dims contiguous)."""
    T, K = x.shape
    h, normed = x.new_empty((T, K)), x.new_empty((T, K))
    if T:
        block = triton.next_power_of_2(K)
        _add_rms_norm_kernel[(T,)](x, delta, norm_weight, h, normed, K, eps, x.stride(0), delta.stride(0),
                                   BLOCK=block, num_warps=max(1, min(16, block // 256)))
    return h, normed
