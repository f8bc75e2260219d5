"""lora_delta: every LoRA-targetable projection gets the batched multi-adapter delta.

    y = linear(x, W)  ->  y = lora_expand(linear(x, W), lora_shrink(x, A, slot), B, scale, slot, slices)

One shrink reads the (fused) input once for all N slices of the projection (qkv: 3, w13: 2,
o / down: 1) and one expand adds each slice's delta. A MoE layer's `fused_moe` gets its expert-LoRA
operands (`lora_a13` ... `lora_slot`): it adds the delta of each token's adapter for each (token,
expert) pair.
`slot` (`[T]`: the adapter slot of each token, -1 for none) is read once per forward.

The adapters' weights live in buffers this pass registers beside each projection's weight
(`lora_a [S, N*R, in]`, `lora_b [S, out, R]`, `lora_scale [S, N]`; experts: `lora_a13`,
`lora_b13`, `lora_a2`, `lora_b2`, `lora_scale`), one slot per adapter the batch may use, ranks
zero-padded to R; the slot pool (`compiled/lora/pool.py`) writes them. Every targetable
projection takes a delta, so the graph does not depend on which adapters are loaded. Runs after
the fusions that build the projections and before those that fold a norm or activation into a
linear (a LoRA'd linear keeps its input, which they then leave alone or keep)."""

from __future__ import annotations

import re

import torch
from torch import fx, nn

import compiled.linear.lora  # noqa: F401  (registers compiled::lora_shrink / lora_expand)
import compiled.linear.lora_slots  # noqa: F401  (registers compiled::lora_token_slots)
import compiled.linear.library  # noqa: F401  (registers compiled::linear)
import compiled.moe.library  # noqa: F401  (registers compiled::fused_moe)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, is_module, is_op
from compiled.passes.calls import build_call, call_args, operands, update_call

# Projection module (relative to a decoder layer) -> the checkpoint projections it computes.
DENSE_TARGETS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.q_proj": ("q_proj",), "self_attn.k_proj": ("k_proj",), "self_attn.v_proj": ("v_proj",),
    "self_attn.o_proj": ("o_proj",),
    "mlp.w13": ("gate_proj", "up_proj"), "mlp.gate_proj": ("gate_proj",), "mlp.up_proj": ("up_proj",),
    "mlp.down_proj": ("down_proj",),
}
_OWNER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def dense_target(owner: str) -> tuple[int, tuple[str, ...]] | None:
    """(layer, projections) if the module at `owner` is a LoRA-targetable projection."""
    m = _OWNER.match(owner)
    if m is None or m.group(2) not in DENSE_TARGETS:
        return None
    return int(m.group(1)), DENSE_TARGETS[m.group(2)]


def lora_delta_pass(max_loras: int, max_rank: int) -> GraphPass:
    """The pass for a pool of `max_loras` slots of rank up to `max_rank`."""
    def lora_delta(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
        slot = _slot_node(gm)
        for node in list(gm.graph.nodes):
            if is_op(node, torch.ops.compiled.fused_moe) and call_args(node)["lora_a13"] is None:
                _expert_delta(gm, node, slot, max_loras, max_rank)
                record.rewrites += 1
            elif (found := _linear(gm, node)) is not None and dense_target(found[1]) is not None:
                _dense_delta(gm, weights, node, found, slot, max_loras, max_rank)
                record.rewrites += 1
        if not slot.users:
            gm.graph.erase_node(slot)
    return GraphPass("lora_delta", lora_delta, after=("fuse_qkv", "fuse_w13", "silu_and_mul", "skinny_linear"))


def _slot_node(gm: fx.GraphModule) -> fx.Node:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(placeholders[-1]):
        return gm.graph.call_function(torch.ops.compiled.lora_token_slots.default, (placeholders[0],))


def _linear(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, str] | None:
    """(input, owner module path) of a bias-free linear call, either form."""
    if is_op(node, torch.ops.compiled.linear):
        linear = call_args(node)
        if linear["lora_a"] is None and linear["weight"].op == "get_attr":
            return linear["x"], linear["weight"].target.removesuffix(".weight")
    elif is_module(gm, node, nn.Linear) and len(operands(node)) == 1 and gm.get_submodule(node.target).bias is None:
        return operands(node)[0], node.target
    return None


def _buffer(module: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
    module.register_buffer(name, torch.empty(shape, dtype=dtype, device=device), persistent=False)


def _dense_delta(gm: fx.GraphModule, weights: WeightMap, node: fx.Node, found: tuple[fx.Node, str], slot: fx.Node,
                 S: int, R: int) -> None:
    x, owner = found
    _, projs = dense_target(owner)
    module = gm.get_submodule(owner)
    weight = module.weight
    slices = _slices(gm, weights, owner, projs)
    assert sum(slices) == weight.shape[0], f"{owner}: slices {slices} do not add up to {tuple(weight.shape)}"
    _buffer(module, "lora_a", (S, len(projs) * R, weight.shape[1]), weight.dtype, weight.device)
    _buffer(module, "lora_b", (S, weight.shape[0], R), weight.dtype, weight.device)
    _buffer(module, "lora_scale", (S, len(projs)), torch.float32, weight.device)
    graph = gm.graph
    with graph.inserting_before(node.next):   # inserting_after would stack the new nodes in reverse
        a, b, scale = (graph.get_attr(f"{owner}.{n}") for n in ("lora_a", "lora_b", "lora_scale"))
        shrunk = build_call(graph, torch.ops.compiled.lora_shrink, x=x, a=a, slot=slot)
        expanded = build_call(graph, torch.ops.compiled.lora_expand, y=node, s=shrunk, b=b, scale=scale, slot=slot,
                              slices=slices)
    node.replace_all_uses_with(expanded, delete_user_cb=lambda user: user is not expanded)


def _slices(gm: fx.GraphModule, weights: WeightMap, owner: str, projs: tuple[str, ...]) -> list[int]:
    """Each projection's output rows in the weight: what the weight map built it of (a
    tensor-parallel rank's share of each), or, for a weight it does not list, the config's."""
    pieces = weights.pieces.get(f"{owner}.weight", [])
    if len(pieces) == len(projs):
        return [p.local_shape[0] for p in pieces]
    return [gm.config.projection_shape(p)[1] for p in projs]


def _expert_delta(gm: fx.GraphModule, node: fx.Node, slot: fx.Node, S: int, R: int) -> None:
    owner = call_args(node)["w13"].target.removesuffix(".w13")
    module = gm.get_submodule(owner)
    w13 = module.w13
    E, I2, H = w13.shape
    for name, shape in (("lora_a13", (S, E, 2 * R, H)), ("lora_b13", (S, E, I2, R)),
                        ("lora_a2", (S, E, R, I2 // 2)), ("lora_b2", (S, E, H, R))):
        _buffer(module, name, shape, w13.dtype, w13.device)
    _buffer(module, "lora_scale", (S, 3), torch.float32, w13.device)
    graph = gm.graph
    names = ("lora_a13", "lora_b13", "lora_a2", "lora_b2", "lora_scale")
    with graph.inserting_before(node):   # the buffers' names are the op's operands'
        update_call(node, lora_slot=slot, **{n: graph.get_attr(f"{owner}.{n}") for n in names})


# The pass by name, for pass lists (one slot of rank 1): the engine builds its own from its config.
PASS = lora_delta_pass(max_loras=1, max_rank=1)
