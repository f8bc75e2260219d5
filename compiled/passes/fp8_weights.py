"""fp8_weights: the FP8 linears of a quantized checkpoint keep their float8_e4m3fn weights, and
each op that reads one gets its scale as an operand (`weight_scale`, `w13_scale`, ...).

Runs last, on the fused graph, so the scales follow the fused parameters (`quant/recipes.py`):
a weight becomes FP8 only where its scale has one block grid and every reader of it is an op
that takes the scale; the others stay in the engine dtype and load dequantized."""

from __future__ import annotations

import torch
from torch import fx, nn

import compiled.fusions.moe_norm_linear  # noqa: F401  (registers compiled::moe_add_rms_norm_linear)
import compiled.linear.library  # noqa: F401  (registers the linear family)
import compiled.moe.library  # noqa: F401  (registers compiled::fused_moe)
from compiled.graphs.weights import WeightMap
from compiled.passes.base import GraphPass, PassRecord, note_params
from compiled.passes.calls import call_args, overload, update_call
from compiled.quant.dequant import FP8
from compiled.quant.recipes import scale_recipes

# op -> its weight operands and the scale operand of each; the ops taking several weights take
# the scales of all of them or of none (one weight_block, `fused_moe`'s both-or-neither).
SCALED = {
    "compiled::linear": {"weight": "weight_scale"},
    "compiled::silu_mul_linear": {"weight": "weight_scale"},
    "compiled::add_rms_norm_linear": {"weight": "weight_scale", "delta_weight": "delta_weight_scale"},
    "compiled::fused_moe": {"w13": "w13_scale", "w2": "w2_scale"},
    "compiled::moe_add_rms_norm_linear": {"weight": "weight_scale", "w13": "w13_scale", "w2": "w2_scale"},
}
TOGETHER = ("w13", "w2")


def _op_name(node: fx.Node) -> str | None:
    op = overload(node.target) if node.op == "call_function" else None
    return op.name() if op is not None else None


def _readers_take_scales(node: fx.Node) -> bool:
    """Every reader of the weight `node` is an op that reads it in a slot with a scale."""
    for user in node.users:
        slots = SCALED.get(_op_name(user))
        if slots is None or not any(call_args(user).get(slot) is node for slot in slots):
            return False
    return True


def _fp8_slots(node: fx.Node, chosen: set[str]) -> set[str]:
    """The weight operands of the op call `node` whose parameters are in `chosen`."""
    slots = SCALED.get(_op_name(node), {})
    args = call_args(node) if slots else {}
    return {slot for slot in slots if isinstance(args[slot], fx.Node) and args[slot].target in chosen}


def fp8_weights(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    """Quantized checkpoint: FP8 parameters + scale operands wherever a weight has one block grid
    and only scale-taking ops read it; no-op for an unquantized model."""
    quant = getattr(gm.config, "quantization", None)
    if quant is None:
        return
    recipes = scale_recipes(weights, quant)
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and f"{n.target}_scale" in recipes.shapes]
    chosen = {n.target for n in attrs} - {n.target for n in attrs if not _readers_take_scales(n)}
    for node in gm.graph.nodes:   # expert stacks: both FP8 or neither, before any op is rewritten
        fp8 = _fp8_slots(node, chosen)
        if set(TOGETHER) & fp8 and not set(TOGETHER) <= fp8:
            args = call_args(node)
            chosen -= {args[s].target for s in TOGETHER if isinstance(args[s], fx.Node)}
    for node in list(gm.graph.nodes):
        fp8 = _fp8_slots(node, chosen)
        if not fp8:
            continue
        slots, args = SCALED[_op_name(node)], call_args(node)
        _make_fp8(gm, weights, recipes, record, [args[s].target for s in fp8])
        with gm.graph.inserting_before(node):
            scales = {slots[s]: gm.graph.get_attr(f"{args[s].target}_scale") for s in fp8}
        update_call(node, **scales, weight_block=list(recipes.block))
        record.rewrites += 1


def _make_fp8(gm: fx.GraphModule, weights: WeightMap, recipes, record: PassRecord, targets: list[str]) -> None:
    """Each parameter of `targets` as float8_e4m3fn beside its fp32 scale (once, however many ops read it)."""
    for target in targets:
        owner_name, _, leaf = target.rpartition(".")
        owner = gm.get_submodule(owner_name)
        old = getattr(owner, leaf)
        if old.dtype == FP8:
            continue
        scale_name = f"{target}_scale"
        new = nn.Parameter(torch.empty(old.shape, dtype=FP8, device=old.device), requires_grad=False)
        scale = nn.Parameter(torch.empty(recipes.shapes[scale_name], dtype=torch.float32, device=old.device),
                             requires_grad=False)
        setattr(owner, leaf, new)
        owner.register_parameter(f"{leaf}_scale", scale)
        weights.pieces[scale_name] = recipes.scales.pieces[scale_name]
        note_params(record, {target: new, scale_name: scale}, {target: old})


PASS = GraphPass("fp8_weights", fp8_weights, after=("fuse_qkv", "fuse_w13", "skinny_linear", "lora_delta",
                                                      "fuse_lora_linear", "fuse_norm_linear", "fuse_silu_linear",
                                                      "fuse_moe_norm", "cp_allgather"))
