"""fuse_silu_linear: SiLU-and-mul and the down projection that reads it become one op.

    y = linear(silu_and_mul(gate_up), W)  ->  y = silu_mul_linear(gate_up, W)

At decode sizes, where the skinny GEMM serves the down projection, it computes silu(gate) * up in
its prologue and the activation's own launch goes (compiled/linear/fused.py). A linear with LoRA
operands (from fuse_lora_linear) keeps them. Runs after silu_and_mul and skinny_linear, whose ops
it matches; an activation with other readers is left alone."""

from __future__ import annotations

import torch
from torch import fx

import compiled.linear.library  # noqa: F401  (registers compiled::silu_mul_linear)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_op
from compiled.passes.calls import build_call, call_args


def fuse_silu_linear(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    for node in list(gm.graph.nodes):
        if not is_op(node, torch.ops.compiled.linear):
            continue
        linear = call_args(node)
        act = linear.pop("x")
        if not (isinstance(act, fx.Node) and is_op(act, torch.ops.compiled.silu_and_mul) and len(act.users) == 1):
            continue
        with gm.graph.inserting_before(node):
            fused = build_call(gm.graph, torch.ops.compiled.silu_mul_linear, gate_up=call_args(act)["x"], **linear)
        fused.meta = node.meta.copy()
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        record.rewrites += 1


PASS = GraphPass("fuse_silu_linear", fuse_silu_linear,
                 after=("silu_and_mul", "skinny_linear", "lora_delta", "fuse_lora_linear"))
