"""Expert routing: softmax over all experts in fp32, top-k, then renormalise if asked.

This is the order HF and SGLang use (one reference document describes it the other way round)."""

from __future__ import annotations

import torch


def topk_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits `[T, E]` -> (weights `[T, k]` fp32, expert ids `[T, k]` int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@torch.library.custom_op("compiled::topk_route", mutates_args=())
def topk_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return topk_route_ref(router_logits, top_k, renormalize)


@topk_route.register_fake
def _(router_logits, top_k, renormalize):
    shape = (router_logits.shape[0], top_k)
    return (router_logits.new_empty(shape, dtype=torch.float32),
            router_logits.new_empty(shape, dtype=torch.int64))
