"""`compiled::moe_add_rms_norm_linear`: a MoE layer's experts, the residual add + RMSNorm after
them and the linear that reads the norm (the next layer's qkv), as one op.

    delta = fused_moe(moe_x, weights, ids, w13, w2);  y, h, normed = add_rms_norm_linear(x, delta, ...)

or with each pair's expert-LoRA deltas: `fused_moe_lora(moe_x, weights, ids, w13, w2, a13, b13, a2,
b2, scale, slot)` (the six LoRA tensors given, as the op's last arguments: all or none).

Alone, the experts' k weighted outputs per token are summed by a kernel of their own
(`moe_sum_kernel`), and the norm's kernel reads the sum back. Here one kernel does both
(`moe_sum_add_rms_norm_kernel`): one launch and one `[T, H]` round trip fewer a layer. The CPU
runs the two ops' references in a row. It calls into moe/ and linear/, so it lives above both.

`compiled::moe_add_rms_norm_linear_lora` is the same with the linear's own LoRA deltas (the next
layer's qkv; fuse_moe_norm_lora): at one row and at 17-64 the norm's kernel also runs the shrink
of each normed row, a few programs a token, so the shrink's launch goes (bench/RESULTS.md)."""

from __future__ import annotations

import torch

from compiled.linear import NORM_LORA_MAX_T, SKINNY_MAX_M, fused as fused_linear
from compiled.linear import lora as linear_lora
from compiled.linear.lora_linear import check_lora, linear_then_expand
from compiled.linear.ops import dispatch
from compiled.moe import expert_lora as el
from compiled.moe import fused_moe as fm

LORA_ARGS = ("a13", "b13", "a2", "b2", "lora_scale", "lora_slot")   # fused_moe_lora's, after w2


def sums_in_norm(x: torch.Tensor, moe_x: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether the top-k sum goes into the norm's kernel: the Triton MoE with top-k > 1."""
    return fm.backend(moe_x) == "triton" and topk_ids.shape[1] > 1 and x.stride(-1) == 1


def _check(x: torch.Tensor, moe_x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
           lora: tuple) -> None:
    fused_linear.check_norm(x, moe_x, norm_weight, weight, op="compiled::moe_add_rms_norm_linear", delta_name="moe_x")
    given = [t is not None for t in lora]
    if any(given) and not all(given):
        missing = [n for n, g in zip(LORA_ARGS, given) if not g]
        raise ValueError(f"compiled::moe_add_rms_norm_linear: expert LoRA needs all of {', '.join(LORA_ARGS)}; "
                         f"missing {', '.join(missing)}")


def experts(moe_x, topk_weights, topk_ids, w13, w2, lora: tuple) -> torch.Tensor:
    """The MoE's summed output: `fused_moe`, or `fused_moe_lora` with the LoRA tensors."""
    if lora[0] is None:
        return torch.ops.compiled.fused_moe(moe_x, topk_weights, topk_ids, w13, w2)
    return torch.ops.compiled.fused_moe_lora(moe_x, topk_weights, topk_ids, w13, w2, *lora)


@torch.library.custom_op("compiled::moe_add_rms_norm_linear", mutates_args=())
def moe_add_rms_norm_linear(x: torch.Tensor, moe_x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                            w13: torch.Tensor, w2: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, keep_normed: bool, a13: torch.Tensor | None = None,
                            b13: torch.Tensor | None = None, a2: torch.Tensor | None = None,
                            b2: torch.Tensor | None = None, lora_scale: torch.Tensor | None = None,
                            lora_slot: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm_linear(x, fused_moe(moe_x, ...), norm_weight, eps, weight, keep_normed)`,
    `fused_moe_lora` with the LoRA tensors."""
    lora = (a13, b13, a2, b2, lora_scale, lora_slot)
    _check(x, moe_x, norm_weight, weight, lora)
    if not sums_in_norm(x, moe_x, topk_ids):
        delta = experts(moe_x, topk_weights, topk_ids, w13, w2, lora)
        return torch.ops.compiled.add_rms_norm_linear(x, delta, norm_weight, eps, weight, keep_normed)
    pairs = _pairs(moe_x, topk_weights, topk_ids, w13, w2, lora)
    h, normed = fm.moe_sum_add_rms_norm_triton(pairs, x, norm_weight, eps)
    return dispatch(normed, weight), h, normed if keep_normed else x.new_empty(0)


def _pairs(moe_x, topk_weights, topk_ids, w13, w2, lora: tuple) -> torch.Tensor:
    """The Triton MoE's weighted expert outputs `[T*k, H]`, not summed (the norm's kernel sums them)."""
    if lora[0] is None:
        return fm.fused_moe_triton(moe_x, topk_weights, topk_ids, w13, w2, sum_slots=False)
    el.check_shapes(moe_x, topk_weights, topk_ids, w13, w2, *lora)
    return el.fused_moe_lora_triton(moe_x, topk_weights, topk_ids, w13, w2, *lora, sum_slots=False)


@moe_add_rms_norm_linear.register_fake
def _(x, moe_x, topk_weights, topk_ids, w13, w2, norm_weight, eps, weight, keep_normed, a13=None, b13=None,
      a2=None, b2=None, lora_scale=None, lora_slot=None):
    _check(x, moe_x, norm_weight, weight, (a13, b13, a2, b2, lora_scale, lora_slot))
    return x.new_empty((x.shape[0], weight.shape[0])), torch.empty_like(x), \
        torch.empty_like(x) if keep_normed else x.new_empty(0)


@torch.library.custom_op("compiled::moe_add_rms_norm_linear_lora", mutates_args=())
def moe_add_rms_norm_linear_lora(x: torch.Tensor, moe_x: torch.Tensor, topk_weights: torch.Tensor,
                                 topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, norm_weight: torch.Tensor,
                                 eps: float, weight: torch.Tensor, keep_normed: bool, a: torch.Tensor, b: torch.Tensor,
                                 scale: torch.Tensor, slot: torch.Tensor, slices: list[int],
                                 a13: torch.Tensor | None = None, b13: torch.Tensor | None = None,
                                 a2: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                                 lora_scale: torch.Tensor | None = None, lora_slot: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_add_rms_norm_linear` whose linear (the next layer's qkv) has LoRA deltas: y =
    lora_expand(linear(normed), lora_shrink(normed, a, slot), b, scale, slot, slices). Where the
    norm's kernel sums the experts, at the sizes of `shrink_in_norm`, it also runs the shrink of
    each normed row (no launch of its own), and the skinny GEMM's epilogue adds the deltas where it
    serves the linear."""
    lora = (a13, b13, a2, b2, lora_scale, lora_slot)
    _check_lora(x, moe_x, norm_weight, weight, lora, a, b, scale, slot, slices)
    if not (shrink_in_norm(x.shape[0]) and sums_in_norm(x, moe_x, topk_ids) and linear_lora.use_kernel(x)):
        y, h, normed = moe_add_rms_norm_linear(x, moe_x, topk_weights, topk_ids, w13, w2, norm_weight, eps, weight,
                                               True, *lora)
        y = linear_lora.expand(y, linear_lora.shrink(normed, a, slot), b, scale, slot, slices)
    else:
        pairs = _pairs(moe_x, topk_weights, topk_ids, w13, w2, lora)
        h, normed, s = fm.moe_sum_add_rms_norm_triton(pairs, x, norm_weight, eps, shrink=(a.contiguous(), slot))
        y = linear_then_expand(normed, weight, s, b, scale, slot, slices)
    return y, h, normed if keep_normed else x.new_empty(0)


def shrink_in_norm(T: int) -> bool:
    """One row, where the GEMV's epilogue then adds the deltas (H200, 30B, 8 adapters, b1 3.349,
    3.368 vs 3.428, 3.434 ms), and 17 to NORM_LORA_MAX_T rows. At 2-16 the shrink's own launch
    after cuBLAS measured faster in the engine (b8 9.386, 9.388 vs 9.406-9.472 ms)."""
    return T == 1 or SKINNY_MAX_M < T <= NORM_LORA_MAX_T


def _check_lora(x, moe_x, norm_weight, weight, lora, a, b, scale, slot, slices) -> None:
    _check(x, moe_x, norm_weight, weight, lora)
    check_lora("compiled::moe_add_rms_norm_linear_lora", x, weight, a, b, scale, slot, slices)


@moe_add_rms_norm_linear_lora.register_fake
def _(x, moe_x, topk_weights, topk_ids, w13, w2, norm_weight, eps, weight, keep_normed, a, b, scale, slot, slices,
      a13=None, b13=None, a2=None, b2=None, lora_scale=None, lora_slot=None):
    _check_lora(x, moe_x, norm_weight, weight, (a13, b13, a2, b2, lora_scale, lora_slot), a, b, scale, slot, slices)
    return x.new_empty((x.shape[0], weight.shape[0])), torch.empty_like(x), \
        torch.empty_like(x) if keep_normed else x.new_empty(0)


def moe_add_rms_norm_linear_ref(x, moe_x, topk_weights, topk_ids, w13, w2, norm_weight, eps, weight, *lora):
    """(y, h, normed) from the two ops' torch references (`lora`: fused_moe_lora's six tensors)."""
    delta = (el.fused_moe_lora_ref(moe_x, topk_weights, topk_ids, w13, w2, *lora) if lora
             else fm.fused_moe_ref(moe_x, topk_weights, topk_ids, w13, w2))
    return fused_linear.add_rms_norm_linear_ref(x, delta, norm_weight, eps, weight)
