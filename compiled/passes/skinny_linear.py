"""skinny_linear: bias-free nn.Linear calls become compiled::linear, which runs decode-sized batches
(M <= 16 rows) through the one-launch skinny GEMM and everything else through F.linear.

Runs after the fusing passes (they match nn.Linear modules). The modules stay in place as owners
of their weights, so parameter names, the weight map and the loader are unchanged; the node reads
the weight through get_attr, as the fused MoE reads its experts. The LM head, applied by the
runner outside the graph, is swapped for a SkinnyLinear holding the same weight (ties kept)."""

from __future__ import annotations

import torch
from torch import fx, nn

import compiled.linear.library  # noqa: F401  (registers compiled::linear)
from compiled.linear.ops import SkinnyLinear
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_module
from compiled.passes.calls import build_call, operands


def skinny_linear(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    """call_module(Linear without bias)(x) -> compiled::linear(x, get_attr(<module>.weight)); biased
    linears are left alone. The LM head beside the graph, if bias-free, becomes a SkinnyLinear."""
    for node in list(gm.graph.nodes):
        if not is_module(gm, node, nn.Linear) or gm.get_submodule(node.target).bias is not None:
            continue
        if node.kwargs or len(operands(node)) != 1:
            continue
        with gm.graph.inserting_before(node):
            weight = gm.graph.get_attr(f"{node.target}.weight")
            call = build_call(gm.graph, torch.ops.compiled.linear, x=operands(node)[0], weight=weight)
        call.meta = node.meta.copy()
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        record.rewrites += 1
    head = getattr(gm, "lm_head", None)
    if type(head) is nn.Linear and head.bias is None:
        gm.lm_head = SkinnyLinear.sharing(head)
        record.rewrites += 1


PASS = GraphPass("skinny_linear", skinny_linear, after=("fuse_qkv", "fuse_w13"))
