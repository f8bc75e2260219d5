"""cp_allgather: the graph of a context-parallel prefill, where each rank computes its own share
of the step's tokens (`compiled/parallel/zigzag.py`) through every layer.

    attention(q, k, v, ...)  ->  k_full, v_full = cp_allgather(cat([k, v], 1)).chunk(2, 1)   # one collective
                                 attention(q, k, v, ..., k_full, v_full)
    return hidden            ->  return cp_allgather(hidden)

Every attention stores the K/V of all the step's tokens (every rank keeps the whole KV cache) and
attends with this rank's queries; the final hidden states come back in batch order for the LM
head and the sampler. `compiled::cp_allgather` is a splitting op of the compiled graph
(`parallel.ops.CP_SPLITTING_OPS`). Runs after fuse_qk_norm_rope, whose attention calls it
extends (the gathered K is then the raw projection, normalised and rotated in the attention op)."""

from __future__ import annotations

import operator

import torch
from torch import fx

import compiled.attention.ops  # noqa: F401  (registers compiled::attention)
import compiled.parallel.ops  # noqa: F401  (registers compiled::cp_allgather)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_op
from compiled.passes.calls import call_args, output_value, update_call


def cp_allgather(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    graph = gm.graph
    gather = torch.ops.compiled.cp_allgather.default
    for node in list(graph.nodes):
        if not is_op(node, torch.ops.compiled.attention):
            continue
        attention = call_args(node)
        if attention["k_full"] is not None:
            continue
        k, v = attention["k"], attention["v"]
        with graph.inserting_before(node):
            kv = graph.call_function(torch.ops.aten.cat.default, ([k, v], 1))
            halves = graph.call_function(torch.ops.aten.chunk.default, (graph.call_function(gather, (kv,)), 2, 1))
            k_full = graph.call_function(operator.getitem, (halves, 0))   # K and V have the same heads
            v_full = graph.call_function(operator.getitem, (halves, 1))
        update_call(node, k_full=k_full, v_full=v_full)
        record.rewrites += 1
    output, value = output_value(graph)
    with graph.inserting_before(output):
        hidden = graph.call_function(gather, (value,))
    output.args = (hidden,)
    record.rewrites += 1


PASS = GraphPass("cp_allgather", cp_allgather, after=("fuse_qk_norm_rope", "lora_delta", "fuse_norm_linear",
                                                       "fuse_moe_norm"))
