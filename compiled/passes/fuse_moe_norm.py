"""fuse_moe_norm: a MoE layer's experts and the residual add + RMSNorm + linear after them become one op.

    delta = fused_moe(moe_x, weights, ids, w13, w2);  y, h, normed = add_rms_norm_linear(x, delta, ...)
        -> y, h, normed = moe_add_rms_norm_linear(x, moe_x, weights, ids, w13, w2, ...)

The op sums each token's k expert outputs inside the norm's kernel (compiled/fusions/moe_norm_linear.py).
The experts' LoRA operands (from lora_delta) go in as the op's `moe_lora_*`, the linear's (the
next layer's qkv, from fuse_lora_linear) as its `lora_*`: the norm's kernel then also runs the
qkv's shrink. Runs after fuse_w13 and fuse_norm_linear, whose ops it matches; a MoE output with
other readers (the last layer's, which goes to the final norm) is left alone."""

from __future__ import annotations

import torch
from torch import fx

import compiled.fusions.moe_norm_linear  # noqa: F401  (registers compiled::moe_add_rms_norm_linear)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_op
from compiled.passes.calls import build_call, call_args

EXPERT_LORA = ("lora_a13", "lora_b13", "lora_a2", "lora_b2", "lora_scale")   # fused_moe's, besides lora_slot


def fuse_moe_norm(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if not is_op(node, torch.ops.compiled.add_rms_norm_linear):
            continue
        norm = call_args(node)
        moe = norm.pop("delta")
        if norm["delta_weight"] is not None or not (isinstance(moe, fx.Node) and len(moe.users) == 1
                                                    and is_op(moe, torch.ops.compiled.fused_moe)):
            continue
        experts = call_args(moe)
        slot = experts.pop("lora_slot")
        if slot is not None and norm["lora_slot"] not in (None, slot):
            continue   # one slot operand serves both LoRAs
        values = {k: v for k, v in norm.items() if not k.startswith("delta_")}
        # One weight_block serves the linear's and the experts' scales (the checkpoint's block).
        experts["weight_block"] = experts["weight_block"] or norm["weight_block"]
        values.update(moe_x=experts.pop("x"), lora_slot=slot if norm["lora_slot"] is None else norm["lora_slot"],
                      **{f"moe_{k}": experts.pop(k) for k in EXPERT_LORA}, **experts)
        with graph.inserting_before(node):
            fused = build_call(graph, torch.ops.compiled.moe_add_rms_norm_linear, **values)
        fused.meta = node.meta.copy()
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        graph.erase_node(moe)
        record.rewrites += 1


PASS = GraphPass("fuse_moe_norm", fuse_moe_norm, after=("fuse_w13", "fuse_norm_linear", "lora_delta"))
