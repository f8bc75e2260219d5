"""inline_references: ops without a kernel of their own become their torch reference before Inductor.

Not one of the user's passes: the compilation runs it on each piece it lowers, so that Inductor
fuses the reference with its neighbours instead of calling the op opaquely."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from compiled.passes.base import is_op
from compiled.passes.calls import call_args


def inline_references(graph: fx.GraphModule) -> None:
    """Put the torch reference in place of ops that have no kernel of their own, so Inductor
    fuses them instead of calling them opaquely (silu_and_mul: one fused pointwise kernel rather
    than eager silu and mul). Runs before fake propagation; piece keys are taken before it."""
    for node in list(graph.graph.nodes):
        if not is_op(node, torch.ops.compiled.silu_and_mul):
            continue
        with graph.graph.inserting_before(node):
            halves = graph.graph.call_function(torch.chunk, (call_args(node)["x"], 2, -1))
            gate = graph.graph.call_function(operator.getitem, (halves, 0))
            up = graph.graph.call_function(operator.getitem, (halves, 1))
            act = graph.graph.call_function(F.silu, (gate,))
            fused = graph.graph.call_function(operator.mul, (act, up))
        node.replace_all_uses_with(fused)
        graph.graph.erase_node(node)
    graph.recompile()
