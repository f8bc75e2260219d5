"""fuse_route: a MoE layer's attention output projection, post-attention norm, router and
routing become one op.

    y = linear(attn, w_o);  logits, h, normed = add_rms_norm_linear(x, y, norm_weight, eps, w_router, keep)
    weights, ids = topk_route(logits, top_k, renormalize)
        -> h, normed, weights, ids = linear_add_norm_route(attn, w_o, x, norm_weight, eps, w_router, top_k, renormalize)

At decode sizes one kernel does all of it (compiled/moe/linear_route.py). Runs after
fuse_norm_linear, whose op it matches; a projection or router output with other readers (a LoRA
delta added to the projection, say) is left alone."""

from __future__ import annotations

import operator

import torch
from torch import fx

import compiled.moe.linear_route  # noqa: F401  (registers compiled::linear_add_norm_route)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import PassRecord, is_getitem, is_op, linear_args


def fuse_route(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        match = _match(node)
        if match is None:
            continue
        proj, logits, route = match
        attn, w_o = linear_args(proj)
        x, _, norm_weight, eps, w_router, _ = node.args
        top_k, renormalize = route.args[1:]
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.compiled.linear_add_norm_route.default,
                                        (attn, w_o, x, norm_weight, eps, w_router, top_k, renormalize))
            h, normed, topk_weights, topk_ids = (graph.call_function(operator.getitem, (fused, i)) for i in range(4))
        for user in list(node.users):
            if is_getitem(user, 1):
                user.replace_all_uses_with(h)
            elif is_getitem(user, 2):
                user.replace_all_uses_with(normed)
        for user in list(route.users):
            user.replace_all_uses_with(topk_weights if is_getitem(user, 0) else topk_ids)
        record.rewrites += 1


def _match(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(projection, logits getitem, topk_route) when `node` is an add_rms_norm_linear whose delta
    is a compiled::linear read by nothing else and whose output goes only into a topk_route."""
    if not is_op(node, torch.ops.compiled.add_rms_norm_linear) or node.kwargs:
        return None
    proj = node.args[1]
    if not (isinstance(proj, fx.Node) and linear_args(proj) is not None and len(proj.users) == 1):
        return None
    logits = [u for u in node.users if is_getitem(u, 0)]
    if len(logits) != 1 or len(logits[0].users) != 1:
        return None
    route = next(iter(logits[0].users))
    if not is_op(route, torch.ops.compiled.topk_route) or route.kwargs or route.args[0] is not logits[0]:
        return None
    if not all(is_getitem(u, 0) or is_getitem(u, 1) for u in route.users):
        return None
    return proj, logits[0], route
