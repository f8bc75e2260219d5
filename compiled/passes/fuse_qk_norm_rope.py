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
from compiled.passes.calls import call_args, getitem_source, operands, update_call


def fuse_qk_norm_rope(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    for node in list(gm.graph.nodes):
        if not is_op(node, torch.ops.compiled.attention):
            continue
        attention = call_args(node)
        if attention["q_norm"] is not None or attention["k_full"] is not None:
            continue   # already fused
        rope = _rope_call(gm, attention["q"], attention["k"])
        if rope is None:
            continue
        positions, qn, kn = operands(rope)
        q_norm, k_norm = match_rms_norm(qn), match_rms_norm(kn)
        if q_norm is None or k_norm is None or q_norm[2] != k_norm[2]:
            continue
        with gm.graph.inserting_before(node):
            cos_sin = gm.graph.get_attr(f"{rope.target}.cos_sin")
        update_call(node, q=q_norm[0], k=k_norm[0], q_norm=q_norm[1], k_norm=k_norm[1], positions=positions,
                    cos_sin=cos_sin, eps=q_norm[2])
        record.rewrites += 1


def _rope_call(gm: fx.GraphModule, q, k) -> fx.Node | None:
    """The RotaryEmbedding call whose outputs 0 and 1 are q and k."""
    if not (is_getitem(q, 0) and is_getitem(k, 1) and getitem_source(q) is getitem_source(k)):
        return None
    rope = getitem_source(q)
    if not is_module(gm, rope, RotaryEmbedding) or len(operands(rope)) != 3 or rope.kwargs:
        return None
    return rope


PASS = GraphPass("fuse_qk_norm_rope", fuse_qk_norm_rope)
