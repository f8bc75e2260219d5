"""Dequantization references: block by block with partial edge blocks, per channel, per tensor."""

from __future__ import annotations

import pytest
import torch

from compiled.quant.config import QuantConfig
from compiled.quant.dequant import FP8, dequantize, quantize


def _loop_block_dequant(w: torch.Tensor, s: torch.Tensor, bo: int, bi: int) -> torch.Tensor:
    out = torch.empty(w.shape, dtype=torch.float64)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi)
            out[rows, cols] = w[rows, cols].double() * s[i, j].double()
    return out


@pytest.mark.parametrize("block", [(128, 128), (16, 32), (7, 5)])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_block_dequant_matches_a_loop_over_blocks(block, scale_dtype):
    torch.manual_seed(0)
    quant = QuantConfig("fp8", "block", block)
    w = torch.randn(40, 70)
    q, s = quantize(w, quant, scale_dtype)
    assert q.dtype == FP8 and s.dtype == scale_dtype and tuple(s.shape) == quant.scale_shape(40, 70)
    got = dequantize(q, s, quant, torch.float64)
    assert torch.equal(got, _loop_block_dequant(q, s, *block))
    # quantization error: fp8 e4m3 keeps 3 mantissa bits (plus the bf16 scale's rounding)
    assert (got.float() - w).abs().max() <= 0.08 * w.abs().max()


@pytest.mark.parametrize("scheme", ["channel", "tensor"])
def test_channel_and_tensor_dequant(scheme):
    torch.manual_seed(1)
    quant = QuantConfig("compressed-tensors", scheme)
    w = torch.randn(24, 33) * torch.linspace(0.1, 3, 24)[:, None]
    q, s = quantize(w, quant)
    assert tuple(s.shape) == quant.scale_shape(24, 33)
    got = dequantize(q, s, quant)
    expected = q.double() * (s.double().reshape(24, 1) if scheme == "channel" else s.double())
    assert torch.equal(got, expected.float())
    assert (got - w).abs().max() <= 0.07 * w.abs().max()
