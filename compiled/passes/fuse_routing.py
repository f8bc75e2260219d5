"""fuse_routing: the experts op routes the tokens itself, the routing op goes.

    weights, ids = topk_route(logits, k, renormalize, local_experts);  ... = fused_moe(x, weights, ids, ...)
        ->  ... = fused_moe(x, None, None, ..., router_logits=logits, top_k=k, renormalize=..., local_experts=...)

and so for `moe_add_rms_norm_linear`. Above 128 (token, expert) pairs on the Triton path the
alignment's count kernel routes its own tokens, as the routing kernel would: one launch a layer
fewer. Elsewhere (fewer pairs, the torch path) the op runs the routing op first, so the rewrite
never changes a result. Calls with expert LoRA are left alone: their shrinks read the ids beside
the alignment, on a stream of their own. Runs after fuse_moe_norm (whose op it matches too) and
the LoRA pass."""

from __future__ import annotations

import torch
from torch import fx

import compiled.fusions.moe_norm_linear  # noqa: F401  (registers compiled::moe_add_rms_norm_linear)
import compiled.moe.library  # noqa: F401  (registers compiled::fused_moe)
import compiled.moe.routing  # noqa: F401  (registers compiled::topk_route)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_getitem, is_op
from compiled.passes.calls import call_args, getitem_source, update_call

EXPERT_OPS = {"fused_moe": "lora_a13", "moe_add_rms_norm_linear": "moe_lora_a13"}   # op -> its expert-LoRA operand


def fuse_routing(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if not is_op(node, torch.ops.compiled.topk_route):
            continue
        experts = _only_reader(node)
        if experts is None:
            continue
        update_call(experts, topk_weights=None, topk_ids=None, **call_args(node))
        for output in list(node.users):
            graph.erase_node(output)
        graph.erase_node(node)
        record.rewrites += 1


def _only_reader(route: fx.Node) -> fx.Node | None:
    """The experts-op call that is the only reader of `route`'s weights and ids (as its topk_weights
    and topk_ids) and has no expert LoRA, else None."""
    outputs = list(route.users)
    if len(outputs) != 2 or not all(is_getitem(u, 0) or is_getitem(u, 1) for u in outputs):
        return None
    readers = {r for u in outputs for r in u.users}
    if len(readers) != 1 or any(len(u.users) != 1 for u in outputs):
        return None
    (experts,) = readers
    name = next((n for n in EXPERT_OPS if is_op(experts, getattr(torch.ops.compiled, n))), None)
    if name is None:
        return None
    args = call_args(experts)
    weights, ids = args["topk_weights"], args["topk_ids"]
    routed = (is_getitem(weights, 0) and is_getitem(ids, 1) and getitem_source(weights) is route
              and getitem_source(ids) is route)
    return experts if routed and args[EXPERT_OPS[name]] is None else None


PASS = GraphPass("fuse_routing", fuse_routing, after=("fuse_moe_norm", "lora_delta"))
