"""`compiled::moe_add_rms_norm_linear`: a MoE layer's experts, the residual add + RMSNorm after
them and the linear that reads the norm (the next layer's qkv), as one op.

    delta = fused_moe(moe_x, weights, ids, w13, w2);  y, h, normed = add_rms_norm_linear(x, delta, ...)
        ->  y, h, normed = moe_add_rms_norm_linear(x, moe_x, weights, ids, w13, w2, norm_w, eps, W, keep_normed)

Its optional operands, None by default, come last: the linear's own LoRA (`lora_a`, `lora_b`,
`lora_scale`, `lora_slot`, `lora_slices`, as `compiled::add_rms_norm_linear`'s) and the experts'
(`moe_lora_a13`, `moe_lora_b13`, `moe_lora_a2`, `moe_lora_b2`, `moe_lora_scale`: `compiled::fused_moe`'s
`lora_*`, the same `lora_slot`), each set all or none; then the FP8 scales (`weight_scale` of the
linear, `w13_scale` / `w2_scale` of the experts, one `weight_block`, as the two ops take them);
then the routing operands in place of topk_weights / topk_ids (`router_logits`, `top_k`,
`renormalize`, `local_experts`, as `compiled::fused_moe` takes them).

Alone, the experts' k weighted outputs per token are summed by a kernel of their own
(`moe_sum_kernel`), and the norm's kernel reads the sum back. Here one kernel does both
(`moe_sum_add_rms_norm_kernel`): one launch and one `[T, H]` round trip fewer a layer. The CPU
runs the two ops' references in a row. With the linear's LoRA, at one row and at 17-64 the
norm's kernel also runs the shrink of each normed row, a few programs a token, so the shrink's
launch goes (bench/RESULTS.md). It calls into moe/ and linear/, so it lives above both."""

from __future__ import annotations

import torch

import compiled.linear.library  # noqa: F401  (registers compiled::add_rms_norm_linear)
import compiled.moe.library  # noqa: F401  (registers compiled::fused_moe)
from compiled.linear import NORM_LORA_MAX_T, SKINNY_MAX_M, fused as fused_linear
from compiled.linear import lora as linear_lora
from compiled.linear import fp8 as fp8_linear
from compiled.linear.fp8 import stand_in
from compiled.linear.lora_linear import check_lora, linear_then_expand, lora_operands
from compiled.moe import expert_lora as el
from compiled.moe import fused_moe as fm
from compiled.moe.library import expert_weights
from compiled.moe.routing import Routed, routing_operands
from compiled.quant.dequant import WeightScale, check_scale

OP = "compiled::moe_add_rms_norm_linear"
EXPERT_LORA = ("moe_lora_a13", "moe_lora_b13", "moe_lora_a2", "moe_lora_b2", "moe_lora_scale", "lora_slot")
Tensor = torch.Tensor


def sums_in_norm(x: torch.Tensor, moe_x: torch.Tensor, top_k: int) -> bool:
    """Whether the top-k sum goes into the norm's kernel: the Triton MoE with top-k > 1."""
    return fm.backend(moe_x) == "triton" and top_k > 1 and x.stride(-1) == 1


def _operands(x, moe_x, norm_weight, weight, lora: tuple, expert: tuple) -> tuple[tuple | None, tuple | None]:
    """(the linear's LoRA as lora_linear's a, b, scale, slot, slices; the experts' LoRA as
    fused_moe's a13, b13, a2, b2, scale, slot), each None where not given, checked."""
    fused_linear.check_norm(x, moe_x, norm_weight, weight, op=OP, delta_name="moe_x")
    own = lora_operands(OP, *lora)
    experts_lora = el.lora_operands(OP, *expert, names=EXPERT_LORA) if any(t is not None for t in expert[:5]) else None
    if own is not None:
        check_lora(OP, x, weight, *own)
    return own, experts_lora


@torch.library.custom_op(OP, mutates_args=())
def moe_add_rms_norm_linear(x: Tensor, moe_x: Tensor, topk_weights: Tensor | None, topk_ids: Tensor | None,
                            w13: Tensor, w2: Tensor,
                            norm_weight: Tensor, eps: float, weight: Tensor, keep_normed: bool,
                            lora_a: Tensor | None = None, lora_b: Tensor | None = None,
                            lora_scale: Tensor | None = None, lora_slot: Tensor | None = None,
                            lora_slices: list[int] | None = None, moe_lora_a13: Tensor | None = None,
                            moe_lora_b13: Tensor | None = None, moe_lora_a2: Tensor | None = None,
                            moe_lora_b2: Tensor | None = None, moe_lora_scale: Tensor | None = None,
                            weight_scale: Tensor | None = None, w13_scale: Tensor | None = None,
                            w2_scale: Tensor | None = None, weight_block: list[int] | None = None,
                            router_logits: Tensor | None = None, top_k: int = 0, renormalize: bool = False,
                            local_experts: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`add_rms_norm_linear(x, fused_moe(moe_x, ...), norm_weight, eps, weight, keep_normed)`, with
    the experts' and the linear's LoRA where given. FP8 experts run as `fused_moe` runs them, an FP8
    linear weight as `compiled::linear` runs it (`linear/fp8.py`)."""
    _check_fp8(weight, w13, w2, weight_scale, w13_scale, w2_scale, weight_block)
    fp8 = None if weight_scale is None else WeightScale(weight_scale, weight_block)
    own, expert = _operands(x, moe_x, norm_weight, stand_in(weight, fp8, x.dtype),
                            (lora_a, lora_b, lora_scale, lora_slot, lora_slices),
                            (moe_lora_a13, moe_lora_b13, moe_lora_a2, moe_lora_b2, moe_lora_scale, lora_slot))
    w13, w2, scales = expert_weights(moe_x, w13, w2, w13_scale, w2_scale, weight_block)
    k = top_k if router_logits is not None or topk_ids is None else topk_ids.shape[1]
    in_kernel = expert is None and sums_in_norm(x, moe_x, k)
    topk_weights, topk_ids, route = routing_operands(OP, topk_weights, topk_ids, router_logits, top_k, renormalize,
                                                     local_experts, in_kernel)
    args = (x, moe_x, topk_weights, topk_ids, w13, w2, norm_weight, eps, weight)
    if own is None:
        return _moe_norm_linear(*args, keep_normed, expert, scales, fp8, route)
    return _moe_norm_linear_lora(*args, keep_normed, expert, own, scales, fp8, route)


def _moe_norm_linear(x, moe_x, topk_weights, topk_ids, w13, w2, norm_weight, eps, weight, keep_normed: bool,
                     expert: tuple | None, scales: fm.ExpertScales | None,
                     fp8: WeightScale | None, route: Routed | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The op without the linear's LoRA; `route` only where the norm's kernel sums the experts."""
    if not sums_in_norm(x, moe_x, topk_ids.shape[1]):
        lora = {} if expert is None else dict(zip(el.LORA_OPERANDS, expert))
        experts_fp8 = {} if scales is None else dict(w13_scale=scales.w13, w2_scale=scales.w2,
                                                     weight_block=scales.block)
        delta = torch.ops.compiled.fused_moe(moe_x, topk_weights, topk_ids, w13, w2, **lora, **experts_fp8)
        own_fp8 = {} if fp8 is None else dict(weight_scale=fp8.scale, weight_block=fp8.block)
        return torch.ops.compiled.add_rms_norm_linear(x, delta, norm_weight, eps, weight, keep_normed, **own_fp8)
    pairs, delta = _pairs(moe_x, topk_weights, topk_ids, w13, w2, expert, scales, route)
    # a W8A8 linear's input quantized by the norm's kernel, which holds the rows
    into = fp8_linear.input_buffers(x, weight, fp8)
    h, normed = fm.moe_sum_add_rms_norm_triton(pairs, x, norm_weight, eps, ids=topk_ids, quantize=into, delta=delta)
    return fp8_linear.linear(normed, weight, fp8, into), h, normed if keep_normed else x.new_empty(0)


def _pairs(moe_x, topk_weights, topk_ids, w13, w2, expert: tuple | None,
           scales: fm.ExpertScales | None, route: Routed | None = None) -> el.ExpertOutputs:
    """The Triton MoE's weighted expert outputs `[T*k, H]`, not summed, and the experts' LoRA
    deltas to add (or None): the norm's kernel sums them."""
    if expert is None:
        return el.ExpertOutputs(fm.fused_moe_triton(moe_x, topk_weights, topk_ids, w13, w2, sum_slots=False,
                                                    scales=scales, route=route), None)
    el.check_shapes(moe_x, topk_weights, topk_ids, w13, w2, *expert)
    return el.fused_moe_lora_triton(moe_x, topk_weights, topk_ids, w13, w2, *expert, sum_slots=False, scales=scales)


def _moe_norm_linear_lora(x, moe_x, topk_weights, topk_ids, w13, w2, norm_weight, eps, weight, keep_normed: bool,
                          expert: tuple | None, own: tuple, scales: fm.ExpertScales | None, fp8: WeightScale | None,
                          route: Routed | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The op whose linear (the next layer's qkv) has LoRA deltas: y = lora_expand(linear(normed),
    lora_shrink(normed, a, slot), b, scale, slot, slices). Where the norm's kernel sums the
    experts, at the sizes of `shrink_in_norm`, it also runs the shrink of each normed row (no
    launch of its own) and quantizes the rows for a W8A8 linear, and the skinny GEMM's epilogue
    adds the deltas where it serves the linear."""
    a, b, scale, slot, slices = own
    if not (shrink_in_norm(x.shape[0]) and sums_in_norm(x, moe_x, topk_ids.shape[1]) and linear_lora.use_kernel(x)):
        y, h, normed = _moe_norm_linear(x, moe_x, topk_weights, topk_ids, w13, w2, norm_weight, eps, weight, True,
                                        expert, scales, fp8, route)
        y = linear_lora.expand(y, linear_lora.shrink(normed, a, slot), b, scale, slot, slices)
    else:
        pairs, delta = _pairs(moe_x, topk_weights, topk_ids, w13, w2, expert, scales, route)
        into = fp8_linear.input_buffers(x, weight, fp8)
        h, normed, s = fm.moe_sum_add_rms_norm_triton(pairs, x, norm_weight, eps, shrink=(a.contiguous(), slot),
                                                      ids=topk_ids, quantize=into, delta=delta)
        y = linear_then_expand(normed, weight, s, b, scale, slot, slices, fp8, into)
    return y, h, normed if keep_normed else x.new_empty(0)


def shrink_in_norm(T: int) -> bool:
    """One row, where the GEMV's epilogue then adds the deltas (H200, 30B, 8 adapters, b1 3.349,
    3.368 vs 3.428, 3.434 ms), and 17 to NORM_LORA_MAX_T rows. At 2-16 the shrink's own launch
    after cuBLAS measured faster in the engine (b8 9.386, 9.388 vs 9.406-9.472 ms)."""
    return T == 1 or SKINNY_MAX_M < T <= NORM_LORA_MAX_T


@moe_add_rms_norm_linear.register_fake
def _(x, moe_x, topk_weights, topk_ids, w13, w2, norm_weight, eps, weight, keep_normed, lora_a=None, lora_b=None,
      lora_scale=None, lora_slot=None, lora_slices=None, moe_lora_a13=None, moe_lora_b13=None, moe_lora_a2=None,
      moe_lora_b2=None, moe_lora_scale=None, weight_scale=None, w13_scale=None, w2_scale=None, weight_block=None,
      router_logits=None, top_k=0, renormalize=False, local_experts=None):
    _check_fp8(weight, w13, w2, weight_scale, w13_scale, w2_scale, weight_block)
    routing_operands(OP, topk_weights, topk_ids, router_logits, top_k, renormalize, local_experts, in_kernel=True)
    if weight_scale is not None:
        weight = weight.new_empty(weight.shape, dtype=x.dtype)
    _operands(x, moe_x, norm_weight, weight, (lora_a, lora_b, lora_scale, lora_slot, lora_slices),
              (moe_lora_a13, moe_lora_b13, moe_lora_a2, moe_lora_b2, moe_lora_scale, lora_slot))
    return x.new_empty((x.shape[0], weight.shape[0])), torch.empty_like(x), \
        torch.empty_like(x) if keep_normed else x.new_empty(0)


def _check_fp8(weight, w13, w2, weight_scale, w13_scale, w2_scale, weight_block) -> None:
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError(f"{OP}: w13_scale and w2_scale go together (got only one)")
    if weight_block is not None and weight_scale is None and w13_scale is None:
        raise ValueError(f"{OP}: weight_block without weight_scale or w13_scale / w2_scale")
    for name, w, s in (("weight_scale", weight, weight_scale), ("w13_scale", w13, w13_scale), ("w2_scale", w2, w2_scale)):
        if s is not None:
            check_scale(OP, name, w, s, weight_block)


def moe_add_rms_norm_linear_ref(x, moe_x, topk_weights, topk_ids, w13, w2, norm_weight, eps, weight, *lora):
    """(y, h, normed) from the two ops' torch references (`lora`: fused_moe's six expert-LoRA tensors)."""
    delta = (el.fused_moe_lora_ref(moe_x, topk_weights, topk_ids, w13, w2, *lora) if lora
             else fm.fused_moe_ref(moe_x, topk_weights, topk_ids, w13, w2))
    return fused_linear.add_rms_norm_linear_ref(x, delta, norm_weight, eps, weight)
