"""fuse_lora_linear: a linear and the LoRA shrink and expand of its delta become one op.

    y = lora_expand(linear(x, W), lora_shrink(x, A, slot), B, scale, slot, slices)
        ->  y = linear_lora(x, W, A, B, scale, slot, slices)

At decode sizes the skinny GEMM adds the deltas in its epilogue, after the shrink's launch, which
at a few rows is a short GEMV (compiled/linear/lora_linear.py); elsewhere the op runs the three
as before. Runs after lora_delta, which makes the triples; fuse_norm_linear and fuse_silu_linear
then fold a residual add + RMSNorm or a SiLU-and-mul in front into the op. Left alone: a linear reading the RMSNorm
of a MoE layer's output added to the residual (the 30B's qkv), which fuse_moe_norm folds, expert
sum included, into one op and fuse_moe_norm_lora then its shrink and expand, and a linear or
shrink with other readers."""

from __future__ import annotations

import torch
from torch import fx

import compiled.linear.lora_linear  # noqa: F401  (registers compiled::linear_lora)
import compiled.moe.expert_lora  # noqa: F401  (registers compiled::fused_moe_lora)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_add, is_op, linear_args, match_rms_norm


def fuse_lora_linear(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    for node in list(gm.graph.nodes):
        if not is_op(node, torch.ops.compiled.lora_expand):
            continue
        y, s, *rest = node.args
        if not isinstance(y, fx.Node) or linear_args(y) is None or len(y.users) != 1:
            continue
        x, weight = linear_args(y)
        if not (is_op(s, torch.ops.compiled.lora_shrink) and s.args[0] is x and len(s.users) == 1):
            continue
        if _after_moe(x):
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(torch.ops.compiled.linear_lora.default, (x, weight, s.args[1], *rest))
        fused.meta = node.meta.copy()
        node.replace_all_uses_with(fused)
        for dead in (node, y, s):
            gm.graph.erase_node(dead)
        record.rewrites += 1


def _after_moe(x) -> bool:
    """Whether x is the RMSNorm of a residual add of a MoE layer's output."""
    norm = match_rms_norm(x)
    if norm is None or not is_add(norm[0]):
        return False
    return any(is_op(a, torch.ops.compiled.fused_moe) or is_op(a, torch.ops.compiled.fused_moe_lora)
               for a in norm[0].args)


PASS = GraphPass("fuse_lora_linear", fuse_lora_linear, after=("skinny_linear", "lora_delta"))
