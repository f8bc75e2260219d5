"""FP8 weights as optional operands of the op families: with a scale, each op computes what it
computes with the dequantized weight (block scales with partial edges, per channel, per tensor)."""

from __future__ import annotations

import pytest
import torch

import compiled.linear.library  # noqa: F401  (registers the linear family)
import compiled.moe.library  # noqa: F401  (registers compiled::fused_moe)
from compiled.quant.config import QuantConfig
from compiled.quant.dequant import dequantize_blocks, quantize, resolve_block

ops = torch.ops.compiled
QUANTS = {"block16x24": QuantConfig("fp8", "block", (16, 24)), "block128": QuantConfig("fp8", "block", (128, 128)),
          "channel": QuantConfig("compressed-tensors", "channel"), "tensor": QuantConfig("compressed-tensors", "tensor")}


def _fp8(w: torch.Tensor, quant: QuantConfig, scale_dtype=torch.bfloat16):
    """(fp8 weight, the op's scale operand, its block, the dequantized weight) of a `[..., N, K]` weight."""
    rows, cols = w.shape[-2:]
    block = list(quant.op_block)
    bo, bi = resolve_block(block, rows, cols)
    pairs = [quantize(m, quant, scale_dtype) for m in w.reshape(-1, rows, cols)]
    q = torch.stack([p[0] for p in pairs]).reshape(w.shape)
    s = torch.stack([p[1].reshape(-(-rows // bo), -(-cols // bi)) for p in pairs])
    s = s.reshape(*w.shape[:-2], *s.shape[-2:])
    return q, s, block, dequantize_blocks(q, s, block, torch.float32)


@pytest.mark.parametrize("name", list(QUANTS))
def test_linear_family(name):
    torch.manual_seed(0)
    quant = QUANTS[name]
    x, delta, norm = torch.randn(5, 40), torch.randn(5, 40), torch.rand(40) + 0.5
    q, s, block, w = _fp8(torch.randn(56, 40), quant)
    torch.testing.assert_close(ops.linear(x, q, weight_scale=s, weight_block=block), ops.linear(x, w))
    got = ops.add_rms_norm_linear(x, delta, norm, 1e-6, q, True, weight_scale=s, weight_block=block)
    for a, b in zip(got, ops.add_rms_norm_linear(x, delta, norm, 1e-6, w, True)):
        torch.testing.assert_close(a, b)
    qg, sg, bg, wg = _fp8(torch.randn(30, 28), quant)
    gate_up = torch.randn(5, 56)
    torch.testing.assert_close(ops.silu_mul_linear(gate_up, qg, weight_scale=sg, weight_block=bg),
                               ops.silu_mul_linear(gate_up, wg))


def test_add_rms_norm_linear_with_an_fp8_delta_linear():
    torch.manual_seed(0)
    quant = QUANTS["block16x24"]
    x, inner, norm = torch.randn(4, 40), torch.randn(4, 36), torch.rand(40) + 0.5
    q, s, block, w = _fp8(torch.randn(56, 40), quant)
    qd, sd, _, wd = _fp8(torch.randn(40, 36), quant)
    got = ops.add_rms_norm_linear(x, inner, norm, 1e-6, q, True, delta_weight=qd, weight_scale=s,
                                  delta_weight_scale=sd, weight_block=block)
    for a, b in zip(got, ops.add_rms_norm_linear(x, inner, norm, 1e-6, w, True, delta_weight=wd)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["block16x24", "block128", "channel", "tensor"])
def test_fused_moe(name):
    torch.manual_seed(0)
    E, H, I, T, k = 4, 40, 24, 6, 2
    x = torch.randn(T, H)
    topk_weights, topk_ids = torch.rand(T, k), torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    q13, s13, block, w13 = _fp8(torch.randn(E, 2 * I, H), QUANTS[name])
    q2, s2, _, w2 = _fp8(torch.randn(E, H, I), QUANTS[name])
    got = ops.fused_moe(x, topk_weights, topk_ids, q13, q2, w13_scale=s13, w2_scale=s2, weight_block=block)
    torch.testing.assert_close(got, ops.fused_moe(x, topk_weights, topk_ids, w13, w2))


def test_bad_scale_operands_name_the_op_and_operand():
    x = torch.randn(3, 40)
    q, s, block, _ = _fp8(torch.randn(56, 40), QUANTS["block16x24"])
    with pytest.raises(ValueError, match=r"compiled::linear: weight_scale has shape \[4, 1\], expected \[4, 2\]"):
        ops.linear(x, q, weight_scale=s[:, :1], weight_block=block)
    with pytest.raises(ValueError, match="compiled::linear: weight_scale needs weight_block"):
        ops.linear(x, q, weight_scale=s)
    with pytest.raises(ValueError, match="not float8_e4m3fn"):
        ops.linear(x, q.float(), weight_scale=s, weight_block=block)
    w13 = torch.zeros(2, 8, 40, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="w13_scale and w2_scale go together"):
        ops.fused_moe(x, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long), w13, w13, w13_scale=s)


@pytest.mark.parametrize("name", ["block16x24", "channel"])
def test_moe_add_rms_norm_linear(name):
    import compiled.fusions.moe_norm_linear  # noqa: F401  (registers the fused op)
    torch.manual_seed(0)
    E, H, I, T, k = 4, 40, 24, 5, 2
    x, moe_x, norm = torch.randn(T, H), torch.randn(T, H), torch.rand(H) + 0.5
    topk_weights, topk_ids = torch.rand(T, k), torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    q13, s13, block, w13 = _fp8(torch.randn(E, 2 * I, H), QUANTS[name])
    q2, s2, _, w2 = _fp8(torch.randn(E, H, I), QUANTS[name])
    q, s, _, w = _fp8(torch.randn(56, H), QUANTS[name])
    got = ops.moe_add_rms_norm_linear(x, moe_x, topk_weights, topk_ids, q13, q2, norm, 1e-6, q, True,
                                      weight_scale=s, w13_scale=s13, w2_scale=s2, weight_block=block)
    want = ops.moe_add_rms_norm_linear(x, moe_x, topk_weights, topk_ids, w13, w2, norm, 1e-6, w, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
