"""`compiled::fused_moe(x, topk_weights, topk_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
lora_scale, lora_slot)`: the MoE experts over stacked weights, one op with or without expert LoRA.

The LoRA operands come last, None by default, all or none (`expert_lora.py` says what each holds);
the passes build and read the call by name, so that an operand added later (a weight scale, an
expert-parallel group) shifts no other. The op dispatches to the paths it ran as two ops: without
LoRA `fused_moe.py`'s, with it `expert_lora.py`'s, so the kernels and the rounding are theirs."""

from __future__ import annotations

import torch

from compiled.moe import expert_lora as el
from compiled.moe import fused_moe as fm

Tensor = torch.Tensor


@torch.library.custom_op("compiled::fused_moe", mutates_args=())
def fused_moe(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor,
              lora_a13: Tensor | None = None, lora_b13: Tensor | None = None, lora_a2: Tensor | None = None,
              lora_b2: Tensor | None = None, lora_scale: Tensor | None = None,
              lora_slot: Tensor | None = None) -> Tensor:
    """x `[T, H]` routed by topk `[T, k]` over w13 `[E, 2I, H]`, w2 `[E, H, I]` -> `[T, H]`; with
    expert LoRA, each pair's gate, up and down deltas (slot -1: none)."""
    lora = el.lora_operands(el.OP, lora_a13, lora_b13, lora_a2, lora_b2, lora_scale, lora_slot)
    if lora is None:
        if fm.backend(x) == "triton":
            return fm.fused_moe_triton(x, topk_weights, topk_ids, w13, w2)
        return fm.fused_moe_ref(x, topk_weights, topk_ids, w13, w2)
    el.check_shapes(x, topk_weights, topk_ids, w13, w2, *lora)
    if fm.backend(x) == "triton":
        return el.fused_moe_lora_triton(x, topk_weights, topk_ids, w13, w2, *lora)
    return el.fused_moe_lora_ref(x, topk_weights, topk_ids, w13, w2, *lora)


@fused_moe.register_fake
def _(x, topk_weights, topk_ids, w13, w2, lora_a13=None, lora_b13=None, lora_a2=None, lora_b2=None, lora_scale=None,
      lora_slot=None):
    lora = el.lora_operands(el.OP, lora_a13, lora_b13, lora_a2, lora_b2, lora_scale, lora_slot)
    if lora is not None:
        el.check_shapes(x, topk_weights, topk_ids, w13, w2, *lora)
    return torch.empty_like(x)
