"""fuse_lora_norm: a LoRA'd linear whose output is the residual add's delta before an
add_rms_norm_linear becomes one op with it.

    o = linear_lora(inp, W_o, A, B, scale, slot, [N]);  y, h, normed = add_rms_norm_linear(x, o, w, eps, W, keep)
        ->  y, h, normed = linear_lora_add_rms_norm_linear(x, inp, W_o, A, B, scale, slot, w, eps, W, keep)

In a MoE decoder layer that is o_proj before the post-attention norm and the router. Where cuBLAS
runs both linears (above the skinny GEMM's rows) the norm's launch adds o's LoRA deltas and the
expand's own launch goes (compiled/linear/lora_linear.py). Runs after fuse_norm_linear, which makes
add_rms_norm_linear; o must have no other reader. A linear_lora in front of an
add_rms_norm_linear_lora (a dense layer's o_proj and gate/up) stays as it is."""

from __future__ import annotations

import torch
from torch import fx

import compiled.linear.lora_linear  # noqa: F401  (registers compiled::linear_lora_add_rms_norm_linear)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_op


def fuse_lora_norm(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    for node in list(gm.graph.nodes):
        if not is_op(node, torch.ops.compiled.add_rms_norm_linear) or node.kwargs:
            continue
        x, delta, *rest = node.args
        for residual, o in ((x, delta), (delta, x)):   # the add is commutative, as its rounding is
            if _one_slice_linear_lora(o, node):
                break
        else:
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(torch.ops.compiled.linear_lora_add_rms_norm_linear.default,
                                           (residual, *o.args[:6], *rest))
        fused.meta = node.meta.copy()
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        gm.graph.erase_node(o)
        record.rewrites += 1


def _one_slice_linear_lora(o, reader: fx.Node) -> bool:
    return (isinstance(o, fx.Node) and is_op(o, torch.ops.compiled.linear_lora) and not o.kwargs
            and len(o.args[6]) == 1 and set(o.users) == {reader})


PASS = GraphPass("fuse_lora_norm", fuse_lora_norm, after=("fuse_lora_linear", "fuse_norm_linear"))
