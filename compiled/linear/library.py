"""The linear family's custom ops, one op a family, what changes a computation entering as optional
operands rather than as a twin op:

    compiled::linear(x, weight, lora_a, lora_b, lora_scale, lora_slot, lora_slices, weight_scale,
                     weight_block)
    compiled::add_rms_norm_linear(x, delta, norm_weight, eps, weight, keep_normed, lora_a, lora_b,
                                  lora_scale, lora_slot, lora_slices, delta_weight, delta_lora_a,
                                  delta_lora_b, delta_lora_scale, weight_scale, delta_weight_scale,
                                  weight_block)
    compiled::silu_mul_linear(gate_up, weight, lora_a, lora_b, lora_scale, lora_slot, lora_slices,
                              weight_scale, weight_block)

The optional operands come last, None by default (torch.library takes no keyword-only tensors),
and the passes build and read the calls by name (passes/calls.py), so that one added later (a
weight scale, a process group) shifts no other.
`lora_*` are the multi-LoRA delta of the op's own linear (`lora.py`'s shrink and expand: a, b,
scale, the tokens' slots and the output's slices), all or none. `delta_weight` says that the
residual's delta is itself a linear's output, `linear(delta, delta_weight)` with the LoRA of
`delta_lora_*` (one slice, the same slots): o_proj before the post-attention norm and the router.
Its home is add_rms_norm_linear because what the fusion changes is how the op gets its delta: the
norm's launch adds that linear's LoRA deltas (`lora_linear.linear_lora_add_rms_norm_linear`),
while the op's outputs, (y, h, normed), stay the family's.
`weight_scale` (and `delta_weight_scale`) make the weight FP8: float8_e4m3fn times a scale per
`weight_block` [rows, cols] block (`quant/dequant.py`; a scale per channel is the block [1, K]).
On CUDA the skinny GEMM (a few rows; `ops.use_kernel`) and, up to W8A16_MAX_M rows, the W8A16
kernel of `fp8_kernels.py` read the FP8 bytes and scale each tile in registers; past them on Hopper
cuBLAS's W8A8 GEMM (`fp8_cublas.py`); elsewhere (other prefill shapes, the CPU) the op computes
with the dequantized weight, the torch reference (`fp8.kernel_for` decides, with or without LoRA).

Each op dispatches to the bodies it ran as separate ops: without LoRA `fp8.py`'s (`ops.dispatch`
or `fused`'s for a weight in the activations' dtype), with LoRA `lora_linear`'s, so the kernels
and the rounding are the ones they were; an FP8 weight travels with its `WeightScale`."""

from __future__ import annotations

import torch

from compiled.linear import fp8 as fp8_linear
from compiled.linear import fused, lora_linear, ops
from compiled.linear.lora_linear import lora_operands
from compiled.quant.dequant import WeightScale, check_scale

Tensor = torch.Tensor


@torch.library.custom_op("compiled::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, lora_a: Tensor | None = None, lora_b: Tensor | None = None,
           lora_scale: Tensor | None = None, lora_slot: Tensor | None = None,
           lora_slices: list[int] | None = None, weight_scale: Tensor | None = None,
           weight_block: list[int] | None = None) -> Tensor:
    """x `[..., K]`, weight `[N, K]` -> `[..., N]`; with LoRA (x `[T, K]`) plus each row's delta."""
    lora = lora_operands("compiled::linear", lora_a, lora_b, lora_scale, lora_slot, lora_slices)
    fp8 = _fp8("compiled::linear", "weight_scale", weight, weight_scale, weight_block)
    if lora is None:
        return fp8_linear.linear(x, weight, fp8)
    return lora_linear.linear_lora(x, weight, *lora, fp8=fp8)


def _fp8(op: str, name: str, weight: Tensor | None, scale: Tensor | None, block: list[int] | None
         ) -> WeightScale | None:
    """The weight's checked `WeightScale` when it is FP8 (a scale operand given), else None."""
    if scale is None:
        if block is not None:
            raise ValueError(f"{op}: weight_block without {name}")
        return None
    check_scale(op, name, weight, scale, block)
    return WeightScale(scale, block)


@linear.register_fake
def _(x, weight, lora_a=None, lora_b=None, lora_scale=None, lora_slot=None, lora_slices=None, weight_scale=None,
      weight_block=None):
    lora = lora_operands("compiled::linear", lora_a, lora_b, lora_scale, lora_slot, lora_slices)
    weight = _fake_weight("compiled::linear", "weight_scale", weight, weight_scale, weight_block, x.dtype)
    if lora is None:
        ops.check_shapes(x, weight)
    else:
        lora_linear.check_lora("compiled::linear", x, weight, *lora)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("compiled::add_rms_norm_linear", mutates_args=())
def add_rms_norm_linear(x: Tensor, delta: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, keep_normed: bool,
                        lora_a: Tensor | None = None, lora_b: Tensor | None = None,
                        lora_scale: Tensor | None = None, lora_slot: Tensor | None = None,
                        lora_slices: list[int] | None = None, delta_weight: Tensor | None = None,
                        delta_lora_a: Tensor | None = None, delta_lora_b: Tensor | None = None,
                        delta_lora_scale: Tensor | None = None, weight_scale: Tensor | None = None,
                        delta_weight_scale: Tensor | None = None,
                        weight_block: list[int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """x, delta `[T, K]` -> (y `[T, N]`, h = x + delta, normed = RMSNorm(h) or an empty tensor when
    not keep_normed). h is what the residual stream carries on; normed is for other readers. With
    `delta_weight`, delta is the input of the linear whose output the add takes."""
    op = "compiled::add_rms_norm_linear"
    if delta_weight is None and delta_weight_scale is not None:
        raise ValueError(f"{op}: delta_weight_scale without delta_weight")
    lora, delta_lora = _norm_operands(lora_a, lora_b, lora_scale, lora_slot, lora_slices, delta_weight,
                                      delta_lora_a, delta_lora_b, delta_lora_scale)
    fp8 = _fp8(op, "weight_scale", weight, weight_scale, _block(weight_scale, weight_block))
    if delta_weight is not None:
        delta_fp8 = _fp8(op, "delta_weight_scale", delta_weight, delta_weight_scale,
                         _block(delta_weight_scale, weight_block))
        if lora is None and delta_lora is not None:
            return lora_linear.linear_lora_add_rms_norm_linear(x, delta, delta_weight, *delta_lora[:4], norm_weight,
                                                               eps, weight, keep_normed, delta_fp8, fp8)
        delta = fp8_linear.linear(delta, delta_weight, delta_fp8) if delta_lora is None else \
            lora_linear.linear_lora(delta, delta_weight, *delta_lora, fp8=delta_fp8)
    if lora is None:
        return fp8_linear.add_rms_norm_linear(x, delta, norm_weight, eps, weight, keep_normed, fp8)
    return lora_linear.add_rms_norm_linear_lora(x, delta, norm_weight, eps, weight, keep_normed, *lora, fp8=fp8)


def _norm_operands(lora_a, lora_b, lora_scale, lora_slot, lora_slices, delta_weight, delta_lora_a, delta_lora_b,
                   delta_lora_scale) -> tuple[tuple | None, tuple | None]:
    """(the op's own LoRA, the delta linear's LoRA as linear_lora's a, b, scale, slot, slices)."""
    op = "compiled::add_rms_norm_linear"
    lora = lora_operands(op, lora_a, lora_b, lora_scale, lora_slot, lora_slices)
    if delta_lora_a is None and delta_lora_b is None and delta_lora_scale is None:
        return lora, None
    if delta_weight is None:
        raise ValueError(f"{op}: delta_lora_* without delta_weight (the linear they belong to)")
    slices = [delta_weight.shape[0]]
    return lora, lora_operands(op, delta_lora_a, delta_lora_b, delta_lora_scale, lora_slot, slices)


@add_rms_norm_linear.register_fake
def _(x, delta, norm_weight, eps, weight, keep_normed, lora_a=None, lora_b=None, lora_scale=None, lora_slot=None,
      lora_slices=None, delta_weight=None, delta_lora_a=None, delta_lora_b=None, delta_lora_scale=None,
      weight_scale=None, delta_weight_scale=None, weight_block=None):
    op = "compiled::add_rms_norm_linear"
    weight = _fake_weight(op, "weight_scale", weight, weight_scale, _block(weight_scale, weight_block), x.dtype)
    if delta_weight is not None:
        delta_weight = _fake_weight(op, "delta_weight_scale", delta_weight, delta_weight_scale,
                                    _block(delta_weight_scale, weight_block), x.dtype)
    lora, delta_lora = _norm_operands(lora_a, lora_b, lora_scale, lora_slot, lora_slices, delta_weight,
                                      delta_lora_a, delta_lora_b, delta_lora_scale)
    if delta_weight is not None:
        if delta_lora is not None:
            lora_linear.check_delta_lora(x, delta, delta_weight, *delta_lora[:4], norm_weight, weight)
        delta = x.new_empty(()).expand(delta.shape[0], delta_weight.shape[0])
    if lora is None:
        fused.check_norm(x, delta, norm_weight, weight)
    else:
        lora_linear.check_norm_lora(x, delta, norm_weight, weight, *lora)
    return x.new_empty((x.shape[0], weight.shape[0])), torch.empty_like(x), \
        torch.empty_like(x) if keep_normed else x.new_empty(0)


@torch.library.custom_op("compiled::silu_mul_linear", mutates_args=())
def silu_mul_linear(gate_up: Tensor, weight: Tensor, lora_a: Tensor | None = None, lora_b: Tensor | None = None,
                    lora_scale: Tensor | None = None, lora_slot: Tensor | None = None,
                    lora_slices: list[int] | None = None, weight_scale: Tensor | None = None,
                    weight_block: list[int] | None = None) -> Tensor:
    """(silu(gate) * up) @ weight.T for gate_up `[T, 2K]` = [gate | up], with LoRA its deltas."""
    op = "compiled::silu_mul_linear"
    lora = lora_operands(op, lora_a, lora_b, lora_scale, lora_slot, lora_slices)
    fp8 = _fp8(op, "weight_scale", weight, weight_scale, weight_block)
    if lora is None:
        return fp8_linear.silu_mul_linear(gate_up, weight, fp8)
    return lora_linear.silu_mul_linear_lora(gate_up, weight, *lora, fp8=fp8)


@silu_mul_linear.register_fake
def _(gate_up, weight, lora_a=None, lora_b=None, lora_scale=None, lora_slot=None, lora_slices=None,
      weight_scale=None, weight_block=None):
    lora = lora_operands("compiled::silu_mul_linear", lora_a, lora_b, lora_scale, lora_slot, lora_slices)
    weight = _fake_weight("compiled::silu_mul_linear", "weight_scale", weight, weight_scale, weight_block,
                          gate_up.dtype)
    if lora is None:
        fused.check_silu(gate_up, weight)
    else:
        lora_linear.check_silu_lora(gate_up, weight, *lora)
    return gate_up.new_empty((gate_up.shape[0], weight.shape[0]))


def _block(scale: Tensor | None, block: list[int] | None) -> list[int] | None:
    """The shared weight_block of an op with two weights, for the one whose scale is given."""
    return block if scale is not None else None


def _fake_weight(op: str, name: str, weight: Tensor, scale: Tensor | None, block: list[int] | None,
                 dtype: torch.dtype) -> Tensor:
    """The weight the shape checks see: with a scale, a checked stand-in in the activations' dtype."""
    if scale is None:
        return weight
    check_scale(op, name, weight, scale, block)
    return weight.new_empty(weight.shape, dtype=dtype)
