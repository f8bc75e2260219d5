"""silu_and_mul: `silu(gate) * up` over the halves of one fused output becomes one op."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

import compiled.linear.activation  # noqa: F401  (registers compiled::silu_and_mul)
from compiled.passes.base import GraphPass, PassRecord, is_getitem
from compiled.passes.calls import getitem_source, operands
from compiled.graphs.weights import WeightMap

_MULS = (operator.mul, torch.mul)
_SILUS = (F.silu, torch.nn.functional.silu)


def silu_and_mul(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    """mul(silu(split(h)[0]), split(h)[1]) with equal halves -> compiled::silu_and_mul(h)."""
    for node in list(gm.graph.nodes):
        source = _match(node)
        if source is None:
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(torch.ops.compiled.silu_and_mul.default, (source,))
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        record.rewrites += 1


def _match(mul: fx.Node) -> fx.Node | None:
    """The fused tensor `h` if `mul` is silu(first half of h) * (second half of h)."""
    if mul.op != "call_function" or mul.target not in _MULS or len(operands(mul)) != 2:
        return None
    silu, up = operands(mul)
    if not (isinstance(silu, fx.Node) and silu.op == "call_function" and silu.target in _SILUS):
        return None
    gate = operands(silu)[0]
    if not (is_getitem(gate, 0) and is_getitem(up, 1) and getitem_source(gate) is getitem_source(up)):
        return None
    split = getitem_source(gate)
    if split.op != "call_function" or split.target is not torch.split or len(operands(split)) != 3:
        return None
    h, sizes, dim = operands(split)
    if dim != -1 or len(sizes) != 2 or sizes[0] != sizes[1] or len(silu.users) != 1:
        return None
    return h


PASS = GraphPass("silu_and_mul", silu_and_mul, after=("fuse_w13",))
