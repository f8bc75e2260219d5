"""tp_shard: the graph of one tensor-parallel rank (Megatron's column/row pairs).

    q/k/v, gate/up (column-parallel)  ->  this rank's output rows: its heads, its intermediate share
    o_proj, down (row-parallel)       ->  its input columns, then  y = all_reduce(linear(x)) (+ bias)
    moe_experts(x, ..., gate, up, down) -> every expert's share of the width, then all_reduce

Query heads split evenly; K/V heads split too, or are replicated when the world exceeds them
(rank r reads K/V head r * kv // world, the one its query heads use). The heads' views and the
attention op see the local head counts; the router, norms, embedding and LM head stay whole on
every rank. The weight map records each rank's slice of every checkpoint tensor, so the loader
reads only that (`WeightMap.shard`). Runs first: the fusing passes then fuse the local linears,
and a LoRA delta on a row-parallel output lands before its all-reduce."""

from __future__ import annotations

import torch
from torch import fx, nn

import compiled.moe.experts  # noqa: F401  (registers compiled::moe_experts)
import compiled.parallel.ops  # noqa: F401  (registers compiled::all_reduce)
from compiled.graphs.weights import WeightMap
from compiled.parallel.tensor import COLUMN_PARALLEL, ROW_PARALLEL, ShardPlan, shard_plan
from compiled.passes.base import GraphPass, PassRecord, is_module, is_op, note_params
from compiled.passes.calls import build_call, call_args, operands

def tp_shard_pass(world: int, rank: int) -> GraphPass:
    """The pass of rank `rank` of `world`."""
    def tp_shard(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
        plan = shard_plan(gm.config, world, rank)
        for node in list(gm.graph.nodes):
            if is_module(gm, node, nn.Linear):
                leaf = node.target.rpartition(".")[2]
                if leaf in COLUMN_PARALLEL:
                    _column(gm, weights, record, node, *plan.span(leaf))
                elif leaf in ROW_PARALLEL:
                    _row(gm, weights, record, node, *plan.span(leaf))
            elif is_op(node, torch.ops.compiled.moe_experts):
                _experts(gm, weights, record, node, plan)
    return GraphPass("tp_shard", tp_shard)


def _replace_linear(gm: fx.GraphModule, record: PassRecord, target: str, inputs: int, outputs: int,
                    bias: bool) -> nn.Linear:
    old: nn.Linear = gm.get_submodule(target)
    w = old.weight
    new = nn.Linear(inputs, outputs, bias=bias, device=w.device, dtype=w.dtype)
    gm.add_submodule(target, new)
    note_params(record, {f"{target}.{k}": t for k, t in new.named_parameters()},
                {f"{target}.{k}": t for k, t in old.named_parameters()})
    return new


def _column(gm: fx.GraphModule, weights: WeightMap, record: PassRecord, node: fx.Node, start: int,
            length: int) -> None:
    old: nn.Linear = gm.get_submodule(node.target)
    _replace_linear(gm, record, node.target, old.in_features, length, old.bias is not None)
    weights.shard(f"{node.target}.weight", 0, start, length)
    if old.bias is not None:
        weights.shard(f"{node.target}.bias", 0, start, length)
    for user in list(node.users):   # the heads' view: (-1, heads, head_dim) -> the local heads
        if user.op == "call_method" and user.target == "view":
            x, rows, heads, head_dim = operands(user)
            user.args = (x, rows, length // head_dim, head_dim)
    record.rewrites += 1


def _row(gm: fx.GraphModule, weights: WeightMap, record: PassRecord, node: fx.Node, start: int,
         length: int) -> None:
    old: nn.Linear = gm.get_submodule(node.target)
    _replace_linear(gm, record, node.target, length, old.out_features, bias=False)
    weights.shard(f"{node.target}.weight", 1, start, length)
    (x,) = operands(node)
    if x.op == "call_method" and x.target == "view":   # the heads flattened: (-1, q_size) -> local
        source, rows, _ = operands(x)
        x.args = (source, rows, length)
    reduced = _all_reduce_after(gm.graph, node)
    if old.bias is not None:   # added once, after the sum (not on every rank's partial)
        owner, _, leaf = node.target.rpartition(".")
        name = f"{owner}.{leaf}_bias"
        gm.get_submodule(owner).register_parameter(f"{leaf}_bias", old.bias)
        weights.concat(name, [(f"{node.target}.bias", old.out_features)])
        note_params(record, {name: old.bias}, {})
        with gm.graph.inserting_after(reduced):
            bias = gm.graph.get_attr(name)
        with gm.graph.inserting_after(bias):
            added = gm.graph.call_function(torch.add, (reduced, bias))
        reduced.replace_all_uses_with(added, delete_user_cb=lambda user: user is not added)
    record.rewrites += 1


def _experts(gm: fx.GraphModule, weights: WeightMap, record: PassRecord, node: fx.Node, plan: ShardPlan) -> None:
    args = call_args(node)
    start, length = plan.span("gate_proj", expert=True)
    for name, dim in (("gate", 1), ("up", 1), ("down", 2)):
        attr = args[name]
        owner, _, leaf = attr.target.rpartition(".")
        old = getattr(gm.get_submodule(owner), leaf)
        shape = list(old.shape)
        shape[dim] = length
        new = nn.Parameter(torch.empty(shape, device=old.device, dtype=old.dtype), requires_grad=False)
        setattr(gm.get_submodule(owner), leaf, new)
        note_params(record, {attr.target: new}, {attr.target: old})
        weights.shard(attr.target, dim - 1, start, length)   # the source is one expert's [rows, cols]
    _all_reduce_after(gm.graph, node)
    record.rewrites += 1


def _all_reduce_after(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """Put `all_reduce(node)` in the place of `node` for every reader of it."""
    with graph.inserting_after(node):
        reduced = build_call(graph, torch.ops.compiled.all_reduce, x=node)
    node.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not reduced)
    return reduced
