"""Sibling linears that read the same input become one linear followed by a split."""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from compiled.passes.base import PassRecord, is_module, note_params
from compiled.passes.calls import operands
from compiled.graphs.weights import WeightMap


def fuse_sibling_linears(gm: fx.GraphModule, weights: WeightMap, record: PassRecord,
                         members: tuple[str, ...], fused: str) -> None:
    """For every module path P with linears P.members[0..n] all reading one input, put one
    linear P.fused (weights concatenated in `members` order) and a split in their place."""
    by_input: dict[tuple[fx.Node, str], dict[str, fx.Node]] = {}
    for node in gm.graph.nodes:
        if not is_module(gm, node, nn.Linear):
            continue
        prefix, _, leaf = node.target.rpartition(".")
        if leaf in members:
            by_input.setdefault((operands(node)[0], prefix), {})[leaf] = node
    for (x, prefix), found in by_input.items():
        if set(found) != set(members):
            continue
        _fuse_group(gm, weights, record, x, prefix, [found[m] for m in members], fused)


def _fuse_group(gm: fx.GraphModule, weights: WeightMap, record: PassRecord, x: fx.Node, prefix: str,
                nodes: list[fx.Node], fused: str) -> None:
    linears: list[nn.Linear] = [gm.get_submodule(n.target) for n in nodes]
    first = linears[0]
    if any(l.in_features != first.in_features or (l.bias is None) != (first.bias is None) for l in linears):
        return
    sizes = [l.out_features for l in linears]
    w = first.weight
    module = nn.Linear(first.in_features, sum(sizes), bias=first.bias is not None, device=w.device, dtype=w.dtype)
    name = f"{prefix}.{fused}"
    gm.add_submodule(name, module)
    removed: dict[str, torch.Tensor] = {}
    for kind in ("weight", "bias"):
        if getattr(first, kind) is None:
            continue
        parts = [(f"{n.target}.{kind}", l.out_features) for n, l in zip(nodes, linears)]
        weights.concat(f"{name}.{kind}", parts)
        removed.update({f"{n.target}.{kind}": getattr(l, kind) for n, l in zip(nodes, linears)})
    created = {f"{name}.{k}": t for k, t in module.named_parameters()}
    note_params(record, created, removed)

    earliest = min(nodes, key=_position(gm.graph))
    with gm.graph.inserting_before(earliest):
        out = gm.graph.call_module(name, (x,))
        split = gm.graph.call_function(torch.split, (out, sizes, -1))
        for i, node in enumerate(nodes):
            part = gm.graph.call_function(operator.getitem, (split, i))
            node.replace_all_uses_with(part)
    for node in nodes:
        gm.graph.erase_node(node)
        gm.delete_submodule(node.target)
    record.rewrites += 1


def _position(graph: fx.Graph):
    order = {node: i for i, node in enumerate(graph.nodes)}
    return order.__getitem__
