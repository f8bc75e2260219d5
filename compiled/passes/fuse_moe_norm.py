"""fuse_moe_norm: a MoE layer's experts and the residual add + RMSNorm + linear after them become one op.

    delta = fused_moe(moe_x, weights, ids, w13, w2);  y, h, normed = add_rms_norm_linear(x, delta, ...)
        -> y, h, normed = moe_add_rms_norm_linear(x, moe_x, weights, ids, w13, w2, ...)

The op sums each token's k expert outputs inside the norm's kernel (compiled/fusions/moe_norm_linear.py).
A MoE with expert LoRA (`fused_moe_lora`, from lora_delta) goes in with its LoRA tensors, and the
linear's own LoRA delta (the shrink of the op's normed output and the expand of its y, both read by
nothing else) goes in with its: the op runs the shrink before the linear and the expand in the
linear's epilogue.
Runs after fuse_w13 and fuse_norm_linear, whose ops it matches; a MoE output with other readers
(the last layer's, which goes to the final norm) is left alone."""

from __future__ import annotations

import torch
from torch import fx

import compiled.fusions.moe_norm_linear  # noqa: F401  (registers compiled::moe_add_rms_norm_linear)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_getitem, is_op


def fuse_moe_norm(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if not is_op(node, torch.ops.compiled.add_rms_norm_linear) or node.kwargs:
            continue
        x, moe, *rest = node.args
        if not (isinstance(moe, fx.Node) and len(moe.users) == 1 and not moe.kwargs):
            continue
        if is_op(moe, torch.ops.compiled.fused_moe):
            args = (x, *moe.args, *rest)
        elif is_op(moe, torch.ops.compiled.fused_moe_lora):
            args = (x, *moe.args[:5], *rest, *moe.args[5:])
        else:
            continue
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.compiled.moe_add_rms_norm_linear.default, args)
        fused.meta = node.meta.copy()
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        graph.erase_node(moe)
        if len(args) == 16:   # with LoRA: the linear's delta, if it has one, goes in too
            _take_linear_delta(graph, fused)
        record.rewrites += 1


def _take_linear_delta(graph: fx.Graph, fused: fx.Node) -> None:
    """`lora_expand(y, lora_shrink(normed, a, slot), b, scale, slot, slices)` on the op's own y and
    normed (getitems 0 and 2): the op takes (a, b, scale, slices) and its y is the expand's."""
    items = {u.args[1]: u for u in fused.users if is_getitem(u, u.args[1])}
    y, normed = items.get(0), items.get(2)
    if y is None or normed is None or len(y.users) != 1:
        return
    expand = next(iter(y.users))
    if not is_op(expand, torch.ops.compiled.lora_expand) or expand.args[0] is not y:
        return
    shrink = expand.args[1]
    slot = fused.args[15]
    if not (is_op(shrink, torch.ops.compiled.lora_shrink) and shrink.args[0] is normed and len(shrink.users) == 1
            and shrink.args[2] is slot and expand.args[4] is slot):
        return
    _, _, b, scale, _, slices = expand.args
    keep_normed = len(normed.users) > 1
    with graph.inserting_before(fused):   # the buffers were read after the op: read them before it
        tensors = [graph.get_attr(n.target) for n in (shrink.args[1], b, scale)]
    fused.args = (*fused.args[:9], keep_normed, *fused.args[10:16], *tensors, list(slices))
    expand.replace_all_uses_with(y)
    graph.erase_node(expand)
    graph.erase_node(shrink)
    if not keep_normed:
        graph.erase_node(normed)


PASS = GraphPass("fuse_moe_norm", fuse_moe_norm, after=("fuse_w13", "fuse_norm_linear", "lora_delta"))
