"""fuse_moe_norm: a MoE layer's experts and the residual add + RMSNorm + linear after them become one op.

    delta = fused_moe(moe_x, weights, ids, w13, w2);  y, h, normed = add_rms_norm_linear(x, delta, ...)
        -> y, h, normed = moe_add_rms_norm_linear(x, moe_x, weights, ids, w13, w2, ...)

The op sums each token's k expert outputs inside the norm's kernel (compiled/fusions/moe_norm_linear.py).
A MoE with expert LoRA (`fused_moe_lora`, from lora_delta) goes in with its LoRA tensors.
Runs after fuse_w13 and fuse_norm_linear, whose ops it matches; a MoE output with other readers
(the last layer's, which goes to the final norm) is left alone."""

from __future__ import annotations

import torch
from torch import fx

import compiled.fusions.moe_norm_linear  # noqa: F401  (registers compiled::moe_add_rms_norm_linear)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_op


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
        record.rewrites += 1


PASS = GraphPass("fuse_moe_norm", fuse_moe_norm, after=("fuse_w13", "fuse_norm_linear", "lora_delta"))
