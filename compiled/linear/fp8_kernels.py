"""W8A16 linear (Triton): `y = x @ (w * scale).T` reading the float8_e4m3fn weight itself.

Decode is memory-bound, so a step should read the FP8 bytes and nothing more: each program
dequantizes its weight tile in registers and multiplies in the activations' dtype with fp32
accumulation. Its K tiles are sized to the scale block where they can be (`quant.dequant.
scale_tiling`), so a tile takes one scale per weight row (`triton_utils.row_scaled`); other blocks
gather a scale per element (`scaled_tile`). Programs own BLOCK_N = 32 output columns, so that the
30B's o_proj (N = 2,048) still spreads over 64 programs a row tile. The torch
reference is the op's dequantize-then-F.linear (`quant/dequant.py`). A few rows take the skinny
GEMM's FP8 path instead (`skinny_kernels`); this kernel serves decode batches above them, up to
W8A16_MAX_M rows (`library.py` routes the calls)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiled.quant.dequant import fit_block_k, kernel_scale, resolve_block
from compiled.triton_utils import row_scaled, scaled_tile

BLOCK_N, MAX_BLOCK_K = 32, 128
MAX_BLOCK_M = 64   # up to 64 rows one row tile: the weight is read once


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym, BO, BI,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                  FP8: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        w_mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=w_mask, other=0.0)
        if FP8 == 2:
            b = row_scaled(w, s_ptr, offs_n, offs_n < N, k0, K, stride_sn, BO, BI, x.dtype, 1)
        else:
            b = scaled_tile(w, s_ptr, offs_n[:, None], offs_k[None, :], w_mask, stride_sn, BO, BI, x.dtype, True)
        if IEEE:
            acc += tl.dot(x, tl.trans(b), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(b))
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: list[int]) -> torch.Tensor:
    """x `[M, K]` (rows contiguous) @ (weight `[N, K]` fp8 x its block `scale`).T -> `[M, N]` in x's dtype."""
    M, K = x.shape
    N = weight.shape[0]
    block_k = fit_block_k(resolve_block(block, N, K)[1], MAX_BLOCK_K)
    ks = kernel_scale(scale, block, N, K, block_k, many=False)
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(M)))
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, block_m))
    _w8a16_kernel[grid](x, weight, ks.scale, y, M, N, K, x.stride(0), weight.stride(0), ks.scale.stride(0),
                        y.stride(0), ks.bo, ks.bi, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
                        IEEE=x.dtype == torch.float32, FP8=ks.mode, num_warps=4, num_stages=4)
    return y
