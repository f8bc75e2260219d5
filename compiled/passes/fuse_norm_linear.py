"""fuse_norm_linear: a residual add + RMSNorm and the linear that reads it become one op.

    h = x + delta;  normed = rms_norm(h, w, eps);  y = linear(normed, W)
        -> y, h, normed = add_rms_norm_linear(x, delta, w, eps, W, keep_normed)

In a decoder layer that is the attention's residual add with the post-attention norm and the
MLP's first linear (the router in a MoE layer), and the MLP's residual add with the next layer's
input norm and its qkv projection. At decode sizes, where the skinny GEMM serves the linear, it
does the add and the norm in its prologue and the launch between the two GEMMs goes; elsewhere
the op runs them as one launch of its own (compiled/linear/fused.py).
h keeps the residual stream going; `keep_normed` where others read the norm too (the MoE experts).
A `linear_lora` (from fuse_lora_linear) becomes `add_rms_norm_linear_lora`, its shrink reading
the normed input inside the op.
Runs after skinny_linear (it matches compiled::linear); the first norm (of the embedding) and the
final one have no add or no linear and stay as they are."""

from __future__ import annotations

import operator

import torch
from torch import fx

import compiled.linear.fused  # noqa: F401  (registers compiled::add_rms_norm_linear)
import compiled.linear.lora_linear  # noqa: F401  (registers compiled::add_rms_norm_linear_lora)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_add, linear_and_lora, match_rms_norm


def fuse_norm_linear(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        args = linear_and_lora(node)
        if args is None:
            continue
        (normed, weight), lora = args
        norm = match_rms_norm(normed)
        if norm is None or not is_add(norm[0]) or weight.op != "get_attr":
            continue
        h, norm_weight, eps = norm
        first, before = _first_user(h, normed)
        keep_normed = len(normed.users) > 1
        op = torch.ops.compiled.add_rms_norm_linear_lora if lora else torch.ops.compiled.add_rms_norm_linear
        with graph.inserting_before(first):
            fused = graph.call_function(op.default, (*h.args, norm_weight, eps, graph.get_attr(weight.target),
                                                     keep_normed, *lora))
            y, h_new, normed_new = (graph.call_function(operator.getitem, (fused, i)) for i in range(3))
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        normed.replace_all_uses_with(normed_new)
        # later readers of h (the next residual add) take the op's; the old norm's own nodes die
        h.replace_all_uses_with(h_new, delete_user_cb=lambda user: user not in before)
        record.rewrites += 1


def _first_user(h: fx.Node, normed: fx.Node) -> tuple[fx.Node, set[fx.Node]]:
    """The first node in graph order that reads `normed`, and the nodes from h up to it (the norm's
    own): a walk over the few nodes in between, not an index of the whole graph per match."""
    before, node = set(), h
    while node not in normed.users:
        before.add(node)
        node = node.next
    return node, before


PASS = GraphPass("fuse_norm_linear", fuse_norm_linear, after=("skinny_linear", "lora_delta", "fuse_lora_linear"))
