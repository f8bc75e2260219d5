"""tp_shard: the graph of one tensor-parallel rank (Megatron's column/row pairs).

    q/k/v, gate/up (column-parallel)  ->  this rank's output rows: its heads, its intermediate share
    o_proj, down (row-parallel)       ->  its input columns, then  y = all_reduce(linear(x)) (+ bias)
    moe_experts(x, ..., gate, up, down) -> every expert's share of the width, then all_reduce
      (expert-parallel: the rank's whole experts, then all_reduce; the topk_route feeding them
       gets local_experts=count, so it keeps only the pairs of the rank's experts)
    embed_tokens(ids) (vocab-parallel)  ->  all_reduce(vocab_embedding(ids, its rows))
    lm_head (beside the graph)          ->  a VocabParallelHead over its rows, gathering the logits

Query heads split evenly; K/V heads split too, or are replicated when the world exceeds them
(rank r reads K/V head r * kv // world, the one its query heads use). The heads' views and the
attention op see the local head counts; the router and norms stay whole on every rank. The
vocabulary is cut in `vocab_rows` per rank, the last shard padded (a tied head shares the
embedding's shard). The weight map records each rank's slice of every checkpoint tensor, so the
loader reads only that (`WeightMap.shard`, and under expert parallelism `keep_experts`). Runs
first: the fusing passes then fuse the local linears, and a LoRA delta on a row-parallel output
lands before its all-reduce."""

from __future__ import annotations

import torch
from torch import fx, nn

import compiled.moe.experts  # noqa: F401  (registers compiled::moe_experts)
import compiled.moe.routing  # noqa: F401  (registers compiled::topk_route)
import compiled.parallel.ops  # noqa: F401  (registers compiled::all_reduce)
import compiled.parallel.vocab  # noqa: F401  (registers compiled::vocab_embedding)
from compiled.graphs.weights import WeightMap
from compiled.parallel.tensor import COLUMN_PARALLEL, ROW_PARALLEL, ShardPlan, shard_plan
from compiled.parallel.vocab import VocabParallelHead
from compiled.passes.base import GraphPass, PassRecord, is_getitem, is_module, is_op, note_params
from compiled.passes.calls import build_call, call_args, getitem_source, operands, update_call

def tp_shard_pass(world: int, rank: int, expert_parallel: bool = False) -> GraphPass:
    """The pass of rank `rank` of `world` (whole experts per rank with `expert_parallel`)."""
    def tp_shard(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
        plan = shard_plan(gm.config, world, rank, expert_parallel)
        for node in list(gm.graph.nodes):
            if is_module(gm, node, nn.Embedding):
                _embedding(gm, weights, record, node, plan)
            elif is_module(gm, node, nn.Linear):
                leaf = node.target.rpartition(".")[2]
                if leaf in COLUMN_PARALLEL:
                    _column(gm, weights, record, node, *plan.span(leaf))
                elif leaf in ROW_PARALLEL:
                    _row(gm, weights, record, node, *plan.span(leaf))
            elif is_op(node, torch.ops.compiled.moe_experts):
                _experts(gm, weights, record, node, plan)
        _lm_head(gm, weights, record, plan)
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
        shape[0], shape[dim] = plan.local_experts, length
        new = nn.Parameter(torch.empty(shape, device=old.device, dtype=old.dtype), requires_grad=False)
        setattr(gm.get_submodule(owner), leaf, new)
        note_params(record, {attr.target: new}, {attr.target: old})
        if plan.expert_parallel:
            weights.keep_experts(attr.target, plan.first_expert, plan.local_experts)
        else:
            weights.shard(attr.target, dim - 1, start, length)   # the source is one expert's [rows, cols]
    if plan.expert_parallel:
        _route_locally(node, plan.local_experts)
    _all_reduce_after(gm.graph, node)
    record.rewrites += 1


def _route_locally(experts: fx.Node, count: int) -> None:
    """The routing stays whole (every rank's router sees every expert); the topk_route feeding
    `experts` gives the rank's experts their pairs only."""
    args = call_args(experts)
    weights, ids = args["topk_weights"], args["topk_ids"]
    route = getitem_source(weights) if is_getitem(weights, 0) and is_getitem(ids, 1) else None
    if route is None or getitem_source(ids) is not route or not is_op(route, torch.ops.compiled.topk_route):
        raise TypeError(f"tp_shard: {experts.format_node()} is not routed by one compiled::topk_route")
    update_call(route, local_experts=count)


def _embedding(gm: fx.GraphModule, weights: WeightMap, record: PassRecord, node: fx.Node, plan: ShardPlan) -> None:
    """The rank's rows of the vocabulary, looked up where the id is one of them, summed over the ranks."""
    old: nn.Embedding = gm.get_submodule(node.target)
    new = nn.Embedding(plan.vocab_rows, old.embedding_dim, device=old.weight.device, dtype=old.weight.dtype)
    gm.add_submodule(node.target, new)
    name = f"{node.target}.weight"
    note_params(record, {name: new.weight}, {name: old.weight})
    start, rows = plan.vocab_span
    weights.shard(name, 0, start, rows)
    (ids,) = operands(node)
    with gm.graph.inserting_before(node):
        weight = gm.graph.get_attr(name)
        lookup = build_call(gm.graph, torch.ops.compiled.vocab_embedding, ids=ids, weight=weight)
    node.replace_all_uses_with(lookup)
    gm.graph.erase_node(node)
    _all_reduce_after(gm.graph, lookup)
    record.rewrites += 1


def _lm_head(gm: fx.GraphModule, weights: WeightMap, record: PassRecord, plan: ShardPlan) -> None:
    """The head beside the graph holds the rank's vocabulary rows (the embedding's, when tied)."""
    old = getattr(gm, "lm_head", None)
    if old is None:
        return
    if gm.config.tie_word_embeddings:
        weight = gm.get_submodule("model.embed_tokens").weight
    else:
        weight = nn.Parameter(old.weight.new_empty((plan.vocab_rows, old.weight.shape[1])), requires_grad=False)
        note_params(record, {"lm_head.weight": weight}, {"lm_head.weight": old.weight})
        weights.shard("lm_head.weight", 0, *plan.vocab_span)
    gm.lm_head = VocabParallelHead(weight, plan.vocab_size)
    record.rewrites += 1


def _all_reduce_after(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """Put `all_reduce(node)` in the place of `node` for every reader of it."""
    with graph.inserting_after(node):
        reduced = build_call(graph, torch.ops.compiled.all_reduce, x=node)
    node.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not reduced)
    return reduced
