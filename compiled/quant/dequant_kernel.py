"""Dequantization on the GPU (Triton): an FP8 weight times its block scale in one pass, for the
linears whose rows are too many for the kernels that read FP8 themselves (a prefill's GEMMs run
on cuBLAS over the result).

One program writes a `[BLOCK_R, BLOCK_C]` tile: it reads the float8 bytes and the scale of each
element's block (a handful of cache lines a tile), multiplies in fp32 and stores in the dtype
asked for: 1 byte read and 2 written an element, where the torch reference (`dequantize_blocks`,
float64 for exactness on the CPU) makes several passes. fp32 then rounded can differ from the
reference's exact product rounded in the last bit of a bf16 value, no more."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiled.quant.dequant import resolve_block

BLOCK_R, BLOCK_C = 32, 128


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, rows, cols, stride_w, stride_s, stride_o, BO, BI,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    w = tl.load(w_ptr + offs_r.to(tl.int64)[:, None] * stride_w + offs_c[None, :], mask=ok, other=0.0)
    s = tl.load(s_ptr + (offs_r // BO)[:, None] * stride_s + (offs_c // BI)[None, :], mask=ok, other=0.0)
    out = (w.to(tl.float32) * s.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_r.to(tl.int64)[:, None] * stride_o + offs_c[None, :], out, mask=ok)


def dequantize_triton(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | list[int],
                      dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_blocks(weight, scale, block, dtype)` for a 2-D weight `[rows, cols]` (fp8)."""
    rows, cols = weight.shape
    bo, bi = resolve_block(block, rows, cols)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    scale = scale.contiguous()
    out = torch.empty(rows, cols, dtype=dtype, device=weight.device)
    grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(cols, BLOCK_C))
    _dequant_kernel[grid](weight, scale, out, rows, cols, weight.stride(0), scale.stride(0), out.stride(0), bo, bi,
                          BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4)
    return out
