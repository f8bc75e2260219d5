"""Dequantization references: W = fp8 x scale, block by block, per channel or per tensor.

Computed in float64 (a float8 value times an fp32 scale needs more than fp32's mantissa to be
exact), then cast to the dtype asked for; the oracle and the CPU path share these functions."""

from __future__ import annotations

import torch

from compiled.quant.config import QuantConfig

FP8 = torch.float8_e4m3fn


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A `[ceil(rows/bo), ceil(cols/bi)]` block scale repeated to `[rows, cols]` (edge blocks cut)."""
    bo, bi = block
    return scale.repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, quant: QuantConfig,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The `[rows, cols]` weight an FP8 `weight` and its `scale` stand for, in `dtype`."""
    w = weight.to(torch.float64)
    s = scale.to(torch.float64)
    rows, cols = w.shape
    if quant.scheme == "block":
        s = expand_block_scale(s, rows, cols, quant.block)
    elif quant.scheme == "channel":
        s = s.reshape(rows, 1)
    else:
        s = s.reshape(())
    return (w * s).to(dtype)


def quantize(weight: torch.Tensor, quant: QuantConfig, scale_dtype: torch.dtype = torch.float32
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale) with each block's / row's / the tensor's largest magnitude at fp8's
    largest finite value, so that `dequantize` inverts it up to fp8 rounding."""
    w = weight.to(torch.float32)
    rows, cols = w.shape
    if quant.scheme == "block":
        bo, bi = quant.block
        nr, nc = -(-rows // bo), -(-cols // bi)
        padded = torch.zeros(nr * bo, nc * bi, dtype=torch.float32, device=w.device)
        padded[:rows, :cols] = w
        amax = padded.view(nr, bo, nc, bi).abs().amax(dim=(1, 3))
    elif quant.scheme == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)
    else:
        amax = w.abs().amax().reshape(1)
    scale = (amax / torch.finfo(FP8).max).clamp(min=1e-12).to(scale_dtype)
    full = expand_block_scale(scale.float(), rows, cols, quant.block) if quant.scheme == "block" else \
        scale.float().reshape(rows, 1) if quant.scheme == "channel" else scale.float().reshape(())
    return (w / full).clamp(-torch.finfo(FP8).max, torch.finfo(FP8).max).to(FP8), scale
