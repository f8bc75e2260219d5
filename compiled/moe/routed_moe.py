"""`compiled::routed_moe`: a MoE layer's routing and experts as one op (the fuse_moe_routing pass).

At decode sizes the routing kernel is a launch of its own that reads a few hundred bytes; here the
MoE's kernels route the tokens themselves (see `fused_moe.Route`): for one token each program of
the first GEMM routes it to find its expert, for a few tokens the alignment kernel routes them
before sorting, and only larger batches launch the routing kernel first. The reference is
`topk_route_ref` followed by `fused_moe_ref`."""

from __future__ import annotations

import torch

from compiled.moe.fused_moe import Route, _backend, fused_moe_ref, fused_moe_triton
from compiled.moe.routing import topk_route_ref


def routed_moe_ref(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   top_k: int, renormalize: bool) -> torch.Tensor:
    weights, ids = topk_route_ref(router_logits, top_k, renormalize)
    return fused_moe_ref(x, weights, ids, w13, w2)


def routed_moe_triton(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      top_k: int, renormalize: bool, **kwargs) -> torch.Tensor:
    """The Triton path; `kwargs` go to `fused_moe_triton` (config, workspace, ...)."""
    T, E = router_logits.shape
    assert T == x.shape[0] and E == w13.shape[0], (router_logits.shape, x.shape, w13.shape)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    route = Route(logits, top_k, bool(renormalize),
                  torch.empty(T, top_k, dtype=torch.float32, device=x.device),
                  torch.empty(T, top_k, dtype=torch.int64, device=x.device))
    return fused_moe_triton(x, route.weights, route.ids, w13, w2, route=route, **kwargs)


@torch.library.custom_op("compiled::routed_moe", mutates_args=())
def routed_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               top_k: int, renormalize: bool) -> torch.Tensor:
    if _backend(x) == "triton":
        return routed_moe_triton(x, router_logits, w13, w2, top_k, renormalize)
    return routed_moe_ref(x, router_logits, w13, w2, top_k, renormalize)


@routed_moe.register_fake
def _(x, router_logits, w13, w2, top_k, renormalize):
    return torch.empty_like(x)
