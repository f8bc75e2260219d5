"""fuse_lora_linear: a linear and the LoRA shrink and expand of its delta become one op, the
linear's with its LoRA operands set.

    y = lora_expand(linear(x, W), lora_shrink(x, A, slot), B, scale, slot, slices)
        ->  y = linear(x, W, lora_a=A, lora_b=B, lora_scale=scale, lora_slot=slot, lora_slices=slices)

At decode sizes the skinny GEMM adds the deltas in its epilogue, after the shrink's launch, which
at a few rows is a short GEMV (compiled/linear/lora_linear.py); elsewhere the op runs the three
as before. Runs after lora_delta, which makes the triples; the fusions after it carry the LoRA
operands into the ops they build: fuse_norm_linear and fuse_silu_linear fold a residual add +
RMSNorm or a SiLU-and-mul in front into the op (and a one-slice LoRA'd o_proj into the
post-attention norm's op), fuse_moe_norm a MoE layer's experts (the next layer's qkv). A linear or
shrink with other readers is left alone."""

from __future__ import annotations

import torch
from torch import fx

import compiled.linear.library  # noqa: F401  (registers compiled::linear)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_op
from compiled.passes.calls import build_call, call_args


def fuse_lora_linear(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    for node in list(gm.graph.nodes):
        if not is_op(node, torch.ops.compiled.lora_expand):
            continue
        expand = call_args(node)
        y, s = expand["y"], expand["s"]
        if not (isinstance(y, fx.Node) and is_op(y, torch.ops.compiled.linear) and len(y.users) == 1):
            continue
        linear = call_args(y)
        if linear["lora_a"] is not None or not is_op(s, torch.ops.compiled.lora_shrink) or len(s.users) != 1:
            continue
        shrink = call_args(s)
        if shrink["x"] is not linear["x"] or shrink["slot"] is not expand["slot"]:
            continue
        lora = dict(lora_a=shrink["a"], lora_b=expand["b"], lora_scale=expand["scale"], lora_slot=expand["slot"],
                    lora_slices=expand["slices"])
        with gm.graph.inserting_before(node):
            fused = build_call(gm.graph, torch.ops.compiled.linear, **{**linear, **lora})
        fused.meta = node.meta.copy()
        node.replace_all_uses_with(fused)
        for dead in (node, y, s):
            gm.graph.erase_node(dead)
        record.rewrites += 1


PASS = GraphPass("fuse_lora_linear", fuse_lora_linear, after=("skinny_linear", "lora_delta"))
