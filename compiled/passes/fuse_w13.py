"""fuse_w13: gate/up become one `w13` GEMM; MoE experts become stacked `w13`/`w2` + fused_moe."""

from __future__ import annotations

import torch
from torch import fx, nn

import compiled.moe.experts  # noqa: F401  (registers compiled::moe_experts)
import compiled.moe.library  # noqa: F401  (registers compiled::fused_moe)
from compiled.passes.base import GraphPass, PassRecord, is_op, note_params
from compiled.passes.calls import build_call, call_args
from compiled.passes.linear_fusion import fuse_sibling_linears
from compiled.graphs.weights import WeightMap


def fuse_w13(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    """Dense MLPs: gate_proj + up_proj -> w13 ([gate; up]) + split. MoE layers: the experts'
    gate/up/down -> w13 [E, 2I, H] ([gate; up] per expert) and w2 [E, H, I] for one fused_moe."""
    fuse_sibling_linears(gm, weights, record, ("gate_proj", "up_proj"), "w13")
    for node in list(gm.graph.nodes):
        if is_op(node, torch.ops.compiled.moe_experts):
            _stack_experts(gm, weights, record, node)


def _stack_experts(gm: fx.GraphModule, weights: WeightMap, record: PassRecord, node: fx.Node) -> None:
    experts = call_args(node)
    gate, up, down = experts["gate"], experts["up"], experts["down"]
    if not all(isinstance(a, fx.Node) and a.op == "get_attr" for a in (gate, up, down)):
        return
    owner = gate.target.rpartition(".experts.")[0]          # e.g. model.layers.3.mlp
    g, d = _attr(gm, gate), _attr(gm, down)
    num, inter, hidden = g.shape
    w13 = nn.Parameter(torch.empty(num, 2 * inter, hidden, device=g.device, dtype=g.dtype), requires_grad=False)
    w2 = nn.Parameter(torch.empty_like(d), requires_grad=False)
    module = gm.get_submodule(owner)
    module.register_parameter("w13", w13)
    module.register_parameter("w2", w2)
    weights.concat(f"{owner}.w13", [(gate.target, inter), (up.target, inter)])
    weights.concat(f"{owner}.w2", [(down.target, hidden)])
    note_params(record, {f"{owner}.w13": w13, f"{owner}.w2": w2},
                {a.target: _attr(gm, a) for a in (gate, up, down)})
    with gm.graph.inserting_before(node):
        w13_node = gm.graph.get_attr(f"{owner}.w13")
        w2_node = gm.graph.get_attr(f"{owner}.w2")
        fused = build_call(gm.graph, torch.ops.compiled.fused_moe, x=experts["x"], topk_weights=experts["topk_weights"],
                           topk_ids=experts["topk_ids"], w13=w13_node, w2=w2_node)
    node.replace_all_uses_with(fused)
    gm.graph.erase_node(node)
    for attr in (gate, up, down):
        if not attr.users:
            gm.graph.erase_node(attr)
    gm.delete_submodule(f"{owner}.experts")
    record.rewrites += 1


def _attr(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    owner, _, name = node.target.rpartition(".")
    return getattr(gm.get_submodule(owner), name)


PASS = GraphPass("fuse_w13", fuse_w13)
