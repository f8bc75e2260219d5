"""fuse_qk_norm_rope: Qwen3's per-head q/k RMSNorm and RoPE move into the attention op.

At decode sizes each of them is a launch of its own that moves a few kilobytes; the attention
kernels apply both to the q and k tiles they load anyway (`compiled/attention/triton_norm_rope.py`).
The rewrite is

    attention(rope(positions, rms_norm(q, wq), rms_norm(k, wk)), v)
        -> attention(q, k, v, ..., wq, wk, positions, rope.cos_sin, eps)

and the norm and rotary nodes die with their last use."""

from __future__ import annotations

import torch
from torch import fx

import compiled.attention.ops  # noqa: F401  (registers compiled::attention)
from compiled.graphs.layers import RotaryEmbedding
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_getitem, is_module, is_op, match_rms_norm


def fuse_qk_norm_rope(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    for node in list(gm.graph.nodes):
        if not is_op(node, torch.ops.compiled.attention) or len(node.args) != 5 or node.kwargs:
            continue   # not attention, or already fused
        q, k, v, layer, scale = node.args
        rope = _rope_call(gm, q, k)
        if rope is None:
            continue
        positions, qn, kn = rope.args
        q_norm, k_norm = match_rms_norm(qn), match_rms_norm(kn)
        if q_norm is None or k_norm is None or q_norm[2] != k_norm[2]:
            continue
        with gm.graph.inserting_before(node):
            cos_sin = gm.graph.get_attr(f"{rope.target}.cos_sin")
        node.args = (q_norm[0], k_norm[0], v, layer, scale, q_norm[1], k_norm[1], positions, cos_sin, q_norm[2])
        record.rewrites += 1


def _rope_call(gm: fx.GraphModule, q, k) -> fx.Node | None:
    """The RotaryEmbedding call whose outputs 0 and 1 are q and k."""
    if not (is_getitem(q, 0) and is_getitem(k, 1) and q.args[0] is k.args[0]):
        return None
    rope = q.args[0]
    if not is_module(gm, rope, RotaryEmbedding) or len(rope.args) != 3 or rope.kwargs:
        return None
    return rope


PASS = GraphPass("fuse_qk_norm_rope", fuse_qk_norm_rope)
