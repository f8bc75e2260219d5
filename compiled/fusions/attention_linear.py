"""`compiled::attention_linear`: attention and the output projection that reads it, as one op.

    o = attention(q, k, v, layer, scale, ...);  y = linear(o.view(-1, Hq * D), W, weight_scale=s, ...)
        ->  y = attention_linear(q, k, v, layer, scale, W, ..., weight_scale=s, ...)

Where the projection's FP8 weight runs W8A8 at the step's row count (its input quantized per
token in groups of 128: cuBLAS past the W8A16 kernel's rows, that kernel's fp8 tiles from 33),
each head's row of D = 128 outputs is one such group: the attention kernels store their output
quantized (`act_quant.store_quantized_rows`, the bits the projection's own quantization would
give), and that launch and the output's 16-bit round trip go. Elsewhere (other row counts, the
torch references) the two run as they would apart. Like `compiled::attention` it splits the
graph for the piecewise CUDA graphs; the projection runs in the eager part there. It calls into
attention/ and linear/, so it lives above both."""

from __future__ import annotations

import torch

from compiled.attention import ops as attention_ops
from compiled.linear import fp8 as fp8_linear
from compiled.linear.fp8 import stand_in
from compiled.quant.act_quant import QuantizedRows
from compiled.quant.dequant import WeightScale, check_scale

OP = "compiled::attention_linear"
Tensor = torch.Tensor


def attention_linear_body(q: Tensor, k: Tensor, v: Tensor, layer: int, scale: float, weight: Tensor,
                          q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                          positions: Tensor | None = None, cos_sin: Tensor | None = None, eps: float = 0.0,
                          weight_scale: Tensor | None = None, weight_block: list[int] | None = None) -> Tensor:
    """`linear(attention(q, k, v, layer, scale, q_norm, ...).view(T, -1), weight, weight_scale=...,
    weight_block=...)`: q `[T, Hq, D]` -> `[T, N]` for weight `[N, Hq * D]` (the op's body; the
    eager submodules between compiled pieces call it directly)."""
    fp8 = _weight_scale(weight, weight_scale, weight_block)
    rope = attention_ops.norm_rope(q, q_norm, k_norm, positions, cos_sin, eps)
    t, hq, d = q.shape
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    x = out.view(t, hq * d)
    into = quantized_input(q, x, weight, fp8)
    attention_ops.attend(q, k, v, layer, scale, rope, out=out, quantized=into)
    return fp8_linear.linear(x, weight, fp8, into)


def quantized_input(q: Tensor, x: Tensor, weight: Tensor, fp8: WeightScale | None) -> QuantizedRows | None:
    """Where the attention kernels store their output `x` `[T, Hq * D]` quantized for x @ weight.T:
    the projection's input buffers (`fp8.input_buffers`) where it quantizes its input in groups
    of D and the attention runs on Triton; else None (the projection takes the 16-bit output)."""
    if attention_ops.backend_for(q) != "triton":
        return None
    into = fp8_linear.input_buffers(x, weight, fp8)
    return into if into is not None and into.group == q.shape[2] else None


def _weight_scale(weight: Tensor, weight_scale: Tensor | None, weight_block: list[int] | None) -> WeightScale | None:
    if weight_scale is None:
        if weight_block is not None:
            raise ValueError(f"{OP}: weight_block without weight_scale")
        return None
    check_scale(OP, "weight_scale", weight, weight_scale, weight_block)
    return WeightScale(weight_scale, weight_block)


attention_linear = torch.library.custom_op(OP, mutates_args=())(attention_linear_body)


@attention_linear.register_fake
def _(q, k, v, layer, scale, weight, q_norm=None, k_norm=None, positions=None, cos_sin=None, eps=0.0,
      weight_scale=None, weight_block=None):
    fp8 = _weight_scale(weight, weight_scale, weight_block)
    weight = stand_in(weight, fp8, q.dtype)
    t, hq, d = q.shape
    if weight.dim() != 2 or weight.shape[1] != hq * d:
        raise ValueError(f"{OP}: weight {tuple(weight.shape)} does not take the attention output's {hq * d} columns")
    return q.new_empty((t, weight.shape[0]))
