"""fuse_lora_linear: a linear and the LoRA expand that adds its delta become one op.

    y = lora_expand(linear(x, W), s, B, scale, slot, slices)  ->  y = linear_lora(x, W, s, B, scale, slot, slices)

At decode sizes the skinny GEMM adds the deltas in its epilogue, so the expand's launch goes
(compiled/linear/lora.py); elsewhere the op runs the two as before. Runs after lora_delta, which
makes the pairs. A linear reading the RMSNorm of a residual add (qkv but the first layer's;
gate/up) is left to fuse_norm_linear, whose prologue saves the norm's launch (and fuse_moe_norm's
the MoE sum's after it): the shrink reads the norm's output, which a GEMM with both the prologue
and this epilogue would make only after the shrink needs it. So is a linear with other readers."""

from __future__ import annotations

import torch
from torch import fx

import compiled.linear.lora  # noqa: F401  (registers compiled::linear_lora)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_add, is_op, linear_args, match_rms_norm


def fuse_lora_linear(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    for node in list(gm.graph.nodes):
        if not is_op(node, torch.ops.compiled.lora_expand):
            continue
        y, *rest = node.args
        if not isinstance(y, fx.Node) or linear_args(y) is None or len(y.users) != 1:
            continue
        norm = match_rms_norm(linear_args(y)[0])
        if norm is not None and is_add(norm[0]):
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(torch.ops.compiled.linear_lora.default, (*y.args, *rest))
        fused.meta = node.meta.copy()
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        gm.graph.erase_node(y)
        record.rewrites += 1


PASS = GraphPass("fuse_lora_linear", fuse_lora_linear, after=("skinny_linear", "lora_delta"))
