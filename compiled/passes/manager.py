"""Runs a configured list of passes in order, checks the graph after each, keeps their records."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import fx

from compiled.errors import CompiledError
from compiled.graphs.trace import example_inputs
from compiled.passes.base import GraphPass, PassRecord, sweep_dead_nodes
from compiled.passes import (cp_allgather, fp8_weights, fuse_lora_linear, fuse_moe_norm, fuse_norm_linear,
                             fuse_qk_norm_rope, fuse_qkv, fuse_routing, fuse_silu_linear, fuse_w13, lora_delta,
                             silu_and_mul, skinny_linear, tp_shard)
from compiled.graphs.weights import WeightMap
from compiled.passes.variant import GraphVariant

# Every pass, in an order that satisfies each pass's `after`.
REGISTRY: dict[str, GraphPass] = {m.PASS.name: m.PASS for m in (
    fuse_qkv, fuse_w13, silu_and_mul, skinny_linear, lora_delta, fuse_lora_linear, fuse_qk_norm_rope,
    fuse_norm_linear, fuse_silu_linear, fuse_moe_norm, fuse_routing, cp_allgather, fp8_weights)}
# What a model without LoRA or context parallelism runs; `with_lora` adds the LoRA deltas (and
# their fusion into the decode linears, whose LoRA operands the default fusions then carry) and
# `with_cp` the context-parallel gathers; a quantized checkpoint's graphs end with fp8_weights.
OPTIONAL_PASSES = ("lora_delta", "fuse_lora_linear", "cp_allgather", "fp8_weights")
DEFAULT_PASSES: tuple[str, ...] = tuple(name for name in REGISTRY if name not in OPTIONAL_PASSES)
PassList = list[str | GraphPass] | tuple[str | GraphPass, ...]
CHECKS = ("each", "end", "none")


def resolve_passes(names: PassList | None) -> list[GraphPass]:
    """The passes of `names` (a name, or a GraphPass built with options such as the LoRA pool's
    sizes), checked for their order."""
    names = DEFAULT_PASSES if names is None else names
    unknown = [n for n in names if not isinstance(n, GraphPass) and n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown pass {unknown[0]!r} (available: {', '.join(REGISTRY)})")
    passes = [n if isinstance(n, GraphPass) else REGISTRY[n] for n in names]
    check_order([p.name for p in passes])
    return passes


def passes_for(variant: GraphVariant, names: PassList | None, max_loras: int = 0,
               max_rank: int = 0, quantized: bool = False) -> list[str | GraphPass]:
    """The pass list of `variant`'s graph, the one place it is chosen: `names` (the config's;
    None: DEFAULT_PASSES), with the LoRA deltas for a pool of `max_loras` slots of rank up to
    `max_rank` and their fusions for a LoRA variant, then the gathers for a context-parallel one;
    a tensor-parallel variant's sharding runs first."""
    chosen = list(DEFAULT_PASSES if names is None else names)
    if variant.tp_size > 1:   # first: the other passes fuse the rank's local linears
        chosen = [tp_shard.tp_shard_pass(variant.tp_size, variant.tp_rank, variant.expert_parallel)] + \
            [n for n in chosen if (n.name if isinstance(n, GraphPass) else n) != "tp_shard"]
    if variant.lora:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"the {variant} graph needs the LoRA pool's sizes (max_loras, max_rank >= 1)")
        chosen = with_lora(chosen, lora_delta.lora_delta_pass(max_loras, max_rank))
    if variant.context_parallel:
        chosen = with_cp(chosen)
    if quantized and "fp8_weights" not in chosen:
        chosen.append("fp8_weights")
    return chosen


def with_lora(names: PassList | None, lora: GraphPass) -> list[str | GraphPass]:
    """`names` with the LoRA pass `lora` placed after the passes it follows and before the rest,
    fuse_lora_linear right after it."""
    names = list(DEFAULT_PASSES if names is None else names)
    names = [n for n in names if (n.name if isinstance(n, GraphPass) else n) not in (lora.name, "fuse_lora_linear")]
    last = max((i for i, n in enumerate(names) if n in lora.after), default=-1)
    return names[:last + 1] + [lora, "fuse_lora_linear"] + names[last + 1:]


def with_cp(names: PassList | None) -> list[str | GraphPass]:
    """`names` with the context-parallel gathers last (they extend the final attention calls)."""
    names = [n for n in (DEFAULT_PASSES if names is None else names)
             if (n.name if isinstance(n, GraphPass) else n) != "cp_allgather"]
    return names + ["cp_allgather"]


class PassOrderError(CompiledError, ValueError):
    """A pass list runs a pass before one whose output it matches, or runs a pass twice."""


def check_order(names: list[str] | tuple[str, ...]) -> None:
    position = {}
    for i, name in enumerate(names):
        if name in position:
            raise PassOrderError(f"pass {name!r} is listed twice")
        position[name] = i
    for name in names:
        for first in REGISTRY[name].after if name in REGISTRY else ():
            if position.get(first, -1) > position[name]:
                raise PassOrderError(f"pass {name!r} must run after {first!r}: list {first!r} before it")


def pass_hashes(names: PassList | None) -> dict[str, str]:
    """Each pass of the list with the hash of its source (artifact and compile-cache keys)."""
    return {p.name: p.uuid for p in resolve_passes(names)}


@dataclass
class PassResult:
    gm: fx.GraphModule
    weights: WeightMap
    records: list[PassRecord] = field(default_factory=list)


def check_graph(gm: fx.GraphModule, num_tokens: int = 3) -> None:
    """Lint, then run the graph on meta tensors for a small batch (the custom ops' fake
    implementations serve them, as for FakeTensors): every node must produce a valid shape."""
    gm.graph.lint()
    ids, positions = example_inputs(num_tokens, gm.config.vocab_size, device="meta")
    with torch.inference_mode():
        out = gm(ids, positions)
    if tuple(out.shape) != (num_tokens, gm.config.hidden_size):
        raise AssertionError(f"graph returns {tuple(out.shape)}, expected {(num_tokens, gm.config.hidden_size)}")


def run_passes(gm: fx.GraphModule, weights: WeightMap, names: PassList | None = None,
               check: str = "each", on_pass=None) -> PassResult:
    """Apply the named passes (default: all) to `gm` in place, updating `weights` (the traced
    model's checkpoint map). `check` says when the graph is run on meta tensors: after every
    pass ("each", tests and dumps), once at the end ("end", a cold start) or not at all ("none":
    a start from an artifact, whose export checked this same graph). `on_pass(name, gm)` is
    called before the first pass with name "traced" and after each pass (for dumps)."""
    if check not in CHECKS:
        raise ValueError(f"check must be one of {', '.join(CHECKS)}, not {check!r}")
    result = PassResult(gm, weights)
    if on_pass:
        on_pass("traced", gm)
    for graph_pass in resolve_passes(names):
        record = PassRecord(graph_pass.name, nodes_before=len(gm.graph.nodes))
        start = time.perf_counter()
        graph_pass.fn(gm, result.weights, record)
        # Passes leave dead nodes (replaced splits, getitems) for one sweep here.
        sweep_dead_nodes(gm.graph)
        record.nodes_after = len(gm.graph.nodes)
        if check == "each" or on_pass:
            gm.recompile()  # code generation is slow on a large graph: only where it is read
        if check == "each":
            check_graph(gm)
        record.seconds = time.perf_counter() - start
        result.records.append(record)
        if on_pass:
            on_pass(graph_pass.name, gm)
    if check != "each" and not on_pass:
        gm.recompile()
    if check == "end":
        check_graph(gm)
    return result
