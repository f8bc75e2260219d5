"""`compiled::fused_moe(x, topk_weights, topk_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
lora_scale, lora_slot, w13_scale, w2_scale, weight_block, router_logits, top_k, renormalize,
local_experts)`: the MoE experts over stacked weights, one op with or without expert LoRA, with or
without FP8 experts, routed or routing.

`router_logits` (with `top_k`, `renormalize`, `local_experts`: `compiled::topk_route`'s operands)
in place of topk_weights / topk_ids: the op routes the tokens itself (the `fuse_routing` pass,
`routing.routing_operands`), on the Triton path without LoRA inside the alignment's count kernel
where that runs (`fused_moe.routes_in_align`), else by the routing op first.

`w13_scale` `[E, ceil(2I/bo), ceil(H/bi)]` and `w2_scale` make the stacked weights FP8 (float8_e4m3fn
times a scale per `weight_block` [bo, bi] block, `quant/dequant.py`): the Triton kernels read the
FP8 bytes and scale each tile in registers; the torch path computes with the dequantized experts,
the reference.

The LoRA operands come last, None by default, all or none (`expert_lora.py` says what each holds);
the passes build and read the call by name, so that an operand added later (a weight scale, an
expert-parallel group) shifts no other. The op dispatches to the paths it ran as two ops: without
LoRA `fused_moe.py`'s, with it `expert_lora.py`'s, so the kernels and the rounding are theirs."""

from __future__ import annotations

import torch

from compiled.moe import expert_lora as el
from compiled.moe import fused_moe as fm
from compiled.moe.routing import routing_operands
from compiled.quant.dequant import FP8, check_scale, scaled_weight

Tensor = torch.Tensor


@torch.library.custom_op("compiled::fused_moe", mutates_args=())
def fused_moe(x: Tensor, topk_weights: Tensor | None, topk_ids: Tensor | None, w13: Tensor, w2: Tensor,
              lora_a13: Tensor | None = None, lora_b13: Tensor | None = None, lora_a2: Tensor | None = None,
              lora_b2: Tensor | None = None, lora_scale: Tensor | None = None,
              lora_slot: Tensor | None = None, w13_scale: Tensor | None = None, w2_scale: Tensor | None = None,
              weight_block: list[int] | None = None, router_logits: Tensor | None = None, top_k: int = 0,
              renormalize: bool = False, local_experts: int | None = None) -> Tensor:
    """x `[T, H]` routed by topk `[T, k]` (or by `router_logits` `[T, E]`) over w13 `[E, 2I, H]`,
    w2 `[E, H, I]` -> `[T, H]`; with expert LoRA, each pair's gate, up and down deltas (slot -1:
    none)."""
    _check_fp8(w13, w2, w13_scale, w2_scale, weight_block)
    lora = el.lora_operands(el.OP, lora_a13, lora_b13, lora_a2, lora_b2, lora_scale, lora_slot)
    triton_path = fm.backend(x) == "triton"
    topk_weights, topk_ids, route = routing_operands(el.OP, topk_weights, topk_ids, router_logits, top_k, renormalize,
                                                     local_experts, in_kernel=triton_path and lora is None)
    if lora is not None:
        el.check_shapes(x, topk_weights, topk_ids, w13, w2, *lora)
    w13, w2, scales = expert_weights(x, w13, w2, w13_scale, w2_scale, weight_block)
    if lora is None:
        if triton_path:
            return fm.fused_moe_triton(x, topk_weights, topk_ids, w13, w2, scales=scales, route=route)
        return fm.fused_moe_ref(x, topk_weights, topk_ids, w13, w2)
    if fm.backend(x) == "triton":
        return el.fused_moe_lora_triton(x, topk_weights, topk_ids, w13, w2, *lora, scales=scales)
    return el.fused_moe_lora_ref(x, topk_weights, topk_ids, w13, w2, *lora)


def expert_weights(x: Tensor, w13: Tensor, w2: Tensor, w13_scale: Tensor | None, w2_scale: Tensor | None,
                   weight_block: list[int] | None) -> tuple[Tensor, Tensor, fm.ExpertScales | None]:
    """The stacked weights the experts compute with: FP8 ones stay FP8 on the Triton path, whose
    kernels scale each tile as they read it, with their `ExpertScales`; the torch path computes
    with the dequantized weights (the reference)."""
    if w13_scale is None:
        return w13, w2, None
    if fm.backend(x) == "triton":
        return w13, w2, fm.ExpertScales(w13_scale, w2_scale, weight_block)
    return (scaled_weight(el.OP, "w13_scale", w13, w13_scale, weight_block, x.dtype),
            scaled_weight(el.OP, "w2_scale", w2, w2_scale, weight_block, x.dtype), None)


@fused_moe.register_fake
def _(x, topk_weights, topk_ids, w13, w2, lora_a13=None, lora_b13=None, lora_a2=None, lora_b2=None, lora_scale=None,
      lora_slot=None, w13_scale=None, w2_scale=None, weight_block=None, router_logits=None, top_k=0,
      renormalize=False, local_experts=None):
    _check_fp8(w13, w2, w13_scale, w2_scale, weight_block)
    lora = el.lora_operands(el.OP, lora_a13, lora_b13, lora_a2, lora_b2, lora_scale, lora_slot)
    topk_weights, topk_ids, _ = routing_operands(el.OP, topk_weights, topk_ids, router_logits, top_k, renormalize,
                                                 local_experts, in_kernel=True)
    if lora is not None:
        el.check_shapes(x, topk_weights, topk_ids, w13, w2, *lora)
    return torch.empty_like(x)


def _check_fp8(w13: Tensor, w2: Tensor, w13_scale: Tensor | None, w2_scale: Tensor | None,
               weight_block: list[int] | None) -> None:
    """Both scales or neither, each fitting its stacked weight; FP8 weights only with their scales."""
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError(f"{el.OP}: w13_scale and w2_scale go together (got only one)")
    if w13_scale is None:
        if weight_block is not None:
            raise ValueError(f"{el.OP}: weight_block without w13_scale / w2_scale")
        for name, w in (("w13", w13), ("w2", w2)):
            if w.dtype == FP8:
                raise ValueError(f"{el.OP}: {name} is float8_e4m3fn without {name}_scale")
        return
    check_scale(el.OP, "w13_scale", w13, w13_scale, weight_block)
    check_scale(el.OP, "w2_scale", w2, w2_scale, weight_block)
