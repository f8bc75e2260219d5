"""fuse_moe_norm_lora: the LoRA shrink and expand of the linear inside a moe_add_rms_norm_linear
(the next layer's qkv) join the op.

    y, h, normed = moe_add_rms_norm_linear(x, moe_x, ..., W, keep_normed, *expert_lora)
    y = lora_expand(y, lora_shrink(normed, A, slot), B, scale, slot, slices)
        ->  y, h, normed = moe_add_rms_norm_linear_lora(x, moe_x, ..., W, keep_normed, A, B, scale, slot, slices,
                                                        *expert_lora)

The norm's kernel, which sums the experts, runs the shrink of each normed row as well, so the
shrink's launch goes (compiled/fusions/moe_norm_linear.py). Runs after fuse_moe_norm; the shrink
and the linear's output must have no other reader, and no reader of the op's other outputs may
come before the expand."""

from __future__ import annotations

import operator

import torch
from torch import fx

import compiled.fusions.moe_norm_linear  # noqa: F401  (registers compiled::moe_add_rms_norm_linear_lora)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_getitem, is_op

KEEP_NORMED = 9   # moe_add_rms_norm_linear's argument


def fuse_moe_norm_lora(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        match = _match(node, order)
        if match is None:
            continue
        moe, outputs, shrink = match
        normed_readers = [u for u in outputs[2].users if u is not shrink]
        lora = node.args[2:]
        args = (*moe.args[:KEEP_NORMED], bool(normed_readers), shrink.args[1], *lora, *moe.args[KEEP_NORMED + 1:])
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.compiled.moe_add_rms_norm_linear_lora.default, args)
            new = [graph.call_function(operator.getitem, (fused, i)) for i in range(3)]
        fused.meta = moe.meta.copy()
        node.replace_all_uses_with(new[0])
        for dead in (node, shrink):
            graph.erase_node(dead)
        for i, old in sorted(outputs.items(), reverse=True):
            old.replace_all_uses_with(new[i])
            graph.erase_node(old)
        graph.erase_node(moe)
        record.rewrites += 1


def _match(node: fx.Node, order: dict) -> tuple[fx.Node, dict[int, fx.Node], fx.Node] | None:
    """(the moe_add_rms_norm_linear, its getitems by index, the shrink) if `node` is the expand of
    its linear's output by the shrink of its normed output, else None."""
    if not is_op(node, torch.ops.compiled.lora_expand) or node.kwargs:
        return None
    y, s, _, _, slot, _ = node.args
    if not (is_getitem(y, 0) and is_op(y.args[0], torch.ops.compiled.moe_add_rms_norm_linear)
            and len(y.users) == 1 and is_op(s, torch.ops.compiled.lora_shrink) and len(s.users) == 1
            and not s.kwargs and s.args[2] is slot and is_getitem(s.args[0], 2) and s.args[0].args[0] is y.args[0]):
        return None
    moe = y.args[0]
    if moe.kwargs or not all(is_getitem(u, u.args[1]) and u.args[1] in (0, 1, 2) for u in moe.users):
        return None
    outputs = {u.args[1]: u for u in moe.users}
    if len(outputs) != len(moe.users):   # one getitem an output, so that each has one new one
        return None
    early = [r for o in outputs.values() for r in o.users if r not in (node, s) and order[r] < order[node]]
    return None if early else (moe, outputs, s)


PASS = GraphPass("fuse_moe_norm_lora", fuse_moe_norm_lora, after=("fuse_moe_norm", "lora_delta"))
