"""fuse_moe_routing: a MoE layer's routing moves into its fused experts op.

    fused_moe(x, *topk_route(logits, k, renormalize), w13, w2)
        -> routed_moe(x, logits, w13, w2, k, renormalize)

At decode sizes the routing kernel costs a launch for a few hundred bytes; `compiled::routed_moe`
routes inside the MoE's own kernels (compiled/moe/routed_moe.py). Runs after fuse_w13, which
makes the fused_moe nodes; a routing whose outputs have other users is left alone."""

from __future__ import annotations

import torch
from torch import fx

import compiled.moe.routed_moe  # noqa: F401  (registers compiled::routed_moe)
import compiled.moe.routing  # noqa: F401  (registers compiled::topk_route)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import PassRecord, is_getitem, is_op


def fuse_moe_routing(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    for node in list(gm.graph.nodes):
        if not is_op(node, torch.ops.compiled.fused_moe) or node.kwargs:
            continue
        x, topk_weights, topk_ids, w13, w2 = node.args
        route = _route_of(topk_weights, topk_ids)
        if route is None:
            continue
        logits, top_k, renormalize = route.args
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(torch.ops.compiled.routed_moe.default,
                                           (x, logits, w13, w2, top_k, renormalize))
        fused.meta = node.meta.copy()
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        record.rewrites += 1


def _route_of(topk_weights, topk_ids) -> fx.Node | None:
    """The topk_route call whose outputs 0 and 1 are these, when nothing else reads them."""
    if not (is_getitem(topk_weights, 0) and is_getitem(topk_ids, 1) and topk_weights.args[0] is topk_ids.args[0]):
        return None
    route = topk_weights.args[0]
    if not is_op(route, torch.ops.compiled.topk_route) or route.kwargs or len(route.args) != 3:
        return None
    if len(topk_weights.users) != 1 or len(topk_ids.users) != 1 or len(route.users) != 2:
        return None
    return route
