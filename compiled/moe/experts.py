"""Expert compute: each token through its top-k experts, weighted and summed.

`moe_experts` takes the experts' gate, up and down weights stacked per projection (the plain
model); the fuse_w13 pass turns them into `w13`/`w2` for `fused_moe`. The reference sorts tokens
by expert once, so it costs one host sync per layer rather than one per expert."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def expert_loop(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """HF's expert loop: for each expert with tokens, `expert(e, x[tokens])` times the routing
    weight cast to x's dtype, added into the output in x's dtype in expert order. Pairs of id -1
    (another rank's expert, `routing.NOT_LOCAL`) sort first and are skipped."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    skipped, *counts = torch.bincount(flat_ids + 1, minlength=num_experts + 1).tolist()
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order].to(x.dtype)
    start = skipped
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tokens = token_of[start:start + n]
        out.index_add_(0, tokens, expert(e, x[tokens]) * weight_of[start:start + n, None])
        start += n
    return out


def moe_experts_ref(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x `[T, H]`; gate/up `[E, I, H]`, down `[E, H, I]` -> `[T, H]`."""
    def expert(e: int, h: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(h, gate[e])) * F.linear(h, up[e]), down[e])
    return expert_loop(x, topk_weights, topk_ids, len(gate), expert)


@torch.library.custom_op("compiled::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return moe_experts_ref(x, topk_weights, topk_ids, gate, up, down)


@moe_experts.register_fake
def _(x, topk_weights, topk_ids, gate, up, down):
    return torch.empty_like(x)
