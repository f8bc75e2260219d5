"""fuse_norm_linear: a residual add + RMSNorm and the linear that reads it become one op.

    h = x + delta;  normed = rms_norm(h, w, eps);  y = linear(normed, W)
        -> y, h, normed = add_rms_norm_linear(x, delta, w, eps, W, keep_normed)

In a decoder layer that is the attention's residual add with the post-attention norm and the
MLP's first linear (the router in a MoE layer), and the MLP's residual add with the next layer's
input norm and its qkv projection. At decode sizes, where the skinny GEMM serves the linear, it
does the add and the norm in its prologue and the launch between the two GEMMs goes; elsewhere
the op runs them as one launch of its own (compiled/linear/fused.py).
h keeps the residual stream going; `keep_normed` where others read the norm too (the MoE experts).
A linear with LoRA operands (from fuse_lora_linear) keeps them, its shrink reading the normed
input inside the op. Where the linear has none and the add's delta is a one-slice linear with LoRA
read by nothing else (a MoE layer's o_proj before the post-attention norm and the router), that
linear joins the op as its `delta_weight` and `delta_lora_*`: where cuBLAS runs both linears the
norm's launch adds o's LoRA deltas and the expand's own launch goes (compiled/linear/lora_linear.py).
A dense layer's o_proj, before a gate/up with LoRA, stays as it is.
Runs after skinny_linear (it matches compiled::linear); the first norm (of the embedding) and the
final one have no add or no linear and stay as they are."""

from __future__ import annotations

import operator

import torch
from torch import fx

import compiled.linear.library  # noqa: F401  (registers compiled::add_rms_norm_linear)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_add, is_op, match_rms_norm
from compiled.passes.calls import build_call, call_args, operands

LORA = ("lora_a", "lora_b", "lora_scale", "lora_slot", "lora_slices")


def fuse_norm_linear(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if not is_op(node, torch.ops.compiled.linear):
            continue
        linear = call_args(node)
        normed, weight = linear["x"], linear["weight"]
        norm = match_rms_norm(normed)
        if norm is None or not is_add(norm[0]) or weight.op != "get_attr":
            continue
        h, norm_weight, eps = norm
        first, before = _first_user(h, normed)
        x, delta = operands(h)
        values = dict(x=x, delta=delta, norm_weight=norm_weight, eps=eps, keep_normed=len(normed.users) > 1,
                      **{name: linear[name] for name in LORA})
        if linear["lora_a"] is None:
            values.update(_lora_linear_delta(h, x, delta))
        with graph.inserting_before(first):
            fused = build_call(graph, torch.ops.compiled.add_rms_norm_linear, weight=graph.get_attr(weight.target),
                               **values)
            y, h_new, normed_new = (graph.call_function(operator.getitem, (fused, i)) for i in range(3))
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        normed.replace_all_uses_with(normed_new)
        # later readers of h (the next residual add) take the op's; the old norm's own nodes die
        h.replace_all_uses_with(h_new, delete_user_cb=lambda user: user not in before)
        record.rewrites += 1


def _lora_linear_delta(h: fx.Node, x, delta) -> dict[str, object]:
    """The op's arguments that fold the add's operand, where it is a one-slice linear with LoRA that
    only the add reads, into the op (the other operand the residual); else none."""
    for residual, o in ((x, delta), (delta, x)):   # the add is commutative, as its rounding is
        if isinstance(o, fx.Node) and is_op(o, torch.ops.compiled.linear) and set(o.users) == {h}:
            linear = call_args(o)
            if linear["lora_a"] is not None and len(linear["lora_slices"]) == 1:
                return dict(x=residual, delta=linear["x"], delta_weight=linear["weight"],
                            delta_lora_a=linear["lora_a"], delta_lora_b=linear["lora_b"],
                            delta_lora_scale=linear["lora_scale"], lora_slot=linear["lora_slot"])
    return {}


def _first_user(h: fx.Node, normed: fx.Node) -> tuple[fx.Node, set[fx.Node]]:
    """The first node in graph order that reads `normed`, and the nodes from h up to it (the norm's
    own): a walk over the few nodes in between, not an index of the whole graph per match."""
    before, node = set(), h
    while node not in normed.users:
        before.add(node)
        node = node.next
    return node, before


PASS = GraphPass("fuse_norm_linear", fuse_norm_linear, after=("skinny_linear", "lora_delta", "fuse_lora_linear"))
