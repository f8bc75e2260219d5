"""fuse_moe_norm: a MoE layer's experts and the residual add + RMSNorm + linear after them become one op.

    delta = fused_moe(moe_x, weights, ids, w13, w2);  y, h, normed = add_rms_norm_linear(x, delta, ...)
        -> y, h, normed = moe_add_rms_norm_linear(x, moe_x, weights, ids, w13, w2, ...)

The op sums each token's k expert outputs inside the norm's kernel (compiled/fusions/moe_norm_linear.py).
A MoE with expert LoRA (`fused_moe_lora`, from lora_delta) goes in with its LoRA tensors. A linear
with a LoRA delta of its own (y only read by `lora_expand(y, lora_shrink(normed, ...))`) stays
out, as `linear_lora` on the op's normed output (`moe_add_rms_norm`), whose shrink then runs beside
its base GEMM. Runs after fuse_w13 and fuse_norm_linear, whose ops it matches; a MoE output with
other readers (the last layer's, which goes to the final norm) is left alone."""

from __future__ import annotations

import operator

import torch
from torch import fx

import compiled.fusions.moe_norm_linear  # noqa: F401  (registers compiled::moe_add_rms_norm(_linear))
import compiled.linear.lora_linear  # noqa: F401  (registers compiled::linear_lora)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_getitem, is_op


def fuse_moe_norm(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if not is_op(node, torch.ops.compiled.add_rms_norm_linear) or node.kwargs:
            continue
        x, moe, norm_weight, eps, weight, keep_normed = node.args
        if not (isinstance(moe, fx.Node) and len(moe.users) == 1 and not moe.kwargs):
            continue
        if is_op(moe, torch.ops.compiled.fused_moe):
            moe_args, expert_lora = moe.args, ()
        elif is_op(moe, torch.ops.compiled.fused_moe_lora):
            moe_args, expert_lora = moe.args[:5], moe.args[5:]
        else:
            continue
        delta = _linear_delta(node)
        with graph.inserting_before(node):
            if delta is None:
                fused = graph.call_function(torch.ops.compiled.moe_add_rms_norm_linear.default,
                                            (x, *moe_args, norm_weight, eps, weight, keep_normed, *expert_lora))
                fused.meta = node.meta.copy()
                node.replace_all_uses_with(fused)
            else:
                _split_off_lora_linear(graph, node, delta, (x, *moe_args, norm_weight, eps, *expert_lora), weight)
        graph.erase_node(node)
        graph.erase_node(moe)
        record.rewrites += 1


def _linear_delta(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(expand, shrink) where y = node[0] is read only by `lora_expand(y, s)` with s =
    `lora_shrink(node[2], ...)` read only there; else None."""
    outputs = {n.args[1]: n for n in node.users if is_getitem(n, n.args[1])}
    y, normed = outputs.get(0), outputs.get(2)
    if y is None or normed is None or len(y.users) != 1:
        return None
    expand = next(iter(y.users))
    if not is_op(expand, torch.ops.compiled.lora_expand) or expand.args[0] is not y or expand.kwargs:
        return None
    shrink = expand.args[1]
    if not (isinstance(shrink, fx.Node) and is_op(shrink, torch.ops.compiled.lora_shrink)
            and shrink.args[0] is normed and len(shrink.users) == 1):
        return None
    return expand, shrink


def _split_off_lora_linear(graph: fx.Graph, node: fx.Node, delta: tuple[fx.Node, fx.Node], norm_args: tuple,
                           weight) -> None:
    """`node`'s outputs from `moe_add_rms_norm(*norm_args)`, inserted before it, and `linear_lora`,
    which replaces the expand (where its LoRA tensors are read) and the shrink; its getitems are erased."""
    expand, shrink = delta
    fused = graph.call_function(torch.ops.compiled.moe_add_rms_norm.default, norm_args)
    h = graph.call_function(operator.getitem, (fused, 0))
    normed = graph.call_function(operator.getitem, (fused, 1))
    with graph.inserting_before(expand):
        y = graph.call_function(torch.ops.compiled.linear_lora.default,
                                (normed, weight, shrink.args[1], *expand.args[2:]))
    y.meta = expand.meta.copy()
    expand.replace_all_uses_with(y)
    graph.erase_node(expand)
    graph.erase_node(shrink)
    for out in list(node.users):
        if out.users:
            out.replace_all_uses_with({1: h, 2: normed}[out.args[1]])
        graph.erase_node(out)


PASS = GraphPass("fuse_moe_norm", fuse_moe_norm, after=("fuse_w13", "fuse_norm_linear", "lora_delta"))
