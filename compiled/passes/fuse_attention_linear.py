"""fuse_attention_linear: an FP8 output projection and the attention it reads become one op.

    o = attention(q, k, v, layer, scale, ...);  y = linear(o.view(-1, Hq * D), W, weight_scale=s, ...)
        ->  y = attention_linear(q, k, v, layer, scale, W, ..., weight_scale=s, ...)

Where the projection runs W8A8, the attention kernels store their output quantized for it and
its quantization launch goes (`compiled/fusions/attention_linear.py`). Runs after fp8_weights,
whose scale operands it matches; a projection with LoRA operands, the attention of a
context-parallel graph (k_full) and an output with other readers are left alone."""

from __future__ import annotations

import torch
from torch import fx

import compiled.attention.ops  # noqa: F401  (registers compiled::attention)
import compiled.fusions.attention_linear  # noqa: F401  (registers compiled::attention_linear)
import compiled.linear.library  # noqa: F401  (registers compiled::linear)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_op
from compiled.passes.calls import build_call, call_args, operands

LORA_OPERANDS = ("lora_a", "lora_b", "lora_scale", "lora_slot", "lora_slices")


def _flattened_attention(x: object) -> fx.Node | None:
    """The attention call whose output `x` is, viewed as `[T, Hq * D]` and read by nothing else."""
    if not (isinstance(x, fx.Node) and x.op == "call_method" and x.target in ("view", "reshape")
            and len(x.users) == 1 and len(operands(x)) == 3 and operands(x)[1] == -1):
        return None
    attention = operands(x)[0]
    if isinstance(attention, fx.Node) and is_op(attention, torch.ops.compiled.attention) and len(attention.users) == 1:
        return attention
    return None


def fuse_attention_linear(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    for node in list(gm.graph.nodes):
        if not is_op(node, torch.ops.compiled.linear):
            continue
        linear = call_args(node)
        if linear["weight_scale"] is None or any(linear[name] is not None for name in LORA_OPERANDS):
            continue
        attention = _flattened_attention(linear["x"])
        if attention is None:
            continue
        operands = call_args(attention)
        if operands.pop("k_full") is not None or operands.pop("v_full") is not None:
            continue
        with gm.graph.inserting_before(node):
            fused = build_call(gm.graph, torch.ops.compiled.attention_linear, **operands, weight=linear["weight"],
                               weight_scale=linear["weight_scale"], weight_block=linear["weight_block"])
        fused.meta = node.meta.copy()
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        record.rewrites += 1


PASS = GraphPass("fuse_attention_linear", fuse_attention_linear, after=("fp8_weights", "cp_allgather"))
