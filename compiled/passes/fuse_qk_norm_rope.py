"""fuse_qk_norm_rope: Qwen3's per-head q/k RMSNorm and RoPE move into the attention op.

At decode sizes each of them is a launch of its own that moves a few kilobytes; the attention
kernels apply both to the q and k tiles they load anyway (`compiled/attention/triton_norm_rope.py`).
The rewrite is

    attention(rope(positions, rms_norm(q, wq), rms_norm(k, wk)), v)
        -> attention(q, k, v, ..., wq, wk, positions, rope.cos_sin, eps)

and the norm and rotary nodes die with their last use."""

from __future__ import annotations

import operator

import torch
from torch import fx

import compiled.attention.ops  # noqa: F401  (registers compiled::attention)
from compiled.graphs.layers import RotaryEmbedding
from compiled.graphs.weights import WeightMap
from compiled.passes.base import PassRecord, is_getitem, is_module, is_op


def fuse_qk_norm_rope(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    for node in list(gm.graph.nodes):
        if not is_op(node, torch.ops.compiled.attention) or len(node.args) != 5 or node.kwargs:
            continue   # not attention, or already fused
        q, k, v, layer, scale = node.args
        rope = _rope_call(gm, q, k)
        if rope is None:
            continue
        positions, qn, kn = rope.args
        q_norm, k_norm = _rms_norm(qn), _rms_norm(kn)
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


def _rms_norm(node) -> tuple[fx.Node, fx.Node, float] | None:
    """(x, weight, eps) if `node` is the traced `layers.rms_norm(x, weight, eps)`:
    weight * (h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) with h = x.float()."""
    if not _call(node, operator.mul, 2):
        return None
    weight, cast = node.args
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and _method(cast, "type_as", 2)):
        return None
    scaled, x = cast.args
    if not _call(scaled, operator.mul, 2):
        return None
    h, rsqrt = scaled.args
    if not (_method(h, "float", 1) and h.args[0] is x and _call(rsqrt, torch.rsqrt, 1)):
        return None
    add = rsqrt.args[0]
    if not _call(add, operator.add, 2) or not isinstance(add.args[1], float):
        return None
    mean = add.args[0]
    if not (_method(mean, "mean", 2) and mean.args[1] == -1 and mean.kwargs == {"keepdim": True}):
        return None
    square = mean.args[0]
    if not (_method(square, "pow", 2) and square.args == (h, 2)):
        return None
    return x, weight, add.args[1]


def _call(node, target, nargs: int) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target \
        and len(node.args) == nargs


def _method(node, name: str, nargs: int) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name and len(node.args) == nargs
