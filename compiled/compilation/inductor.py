"""Inductor for the pieces: each unique piece is compiled once for a symbolic token count.

Compilation goes through `torch._inductor.standalone_compile` on our own graphs (no Dynamo
guessing, so no guards and nothing that can recompile later). Every compile is counted: after
warm-up the count must not move, and a test asserts it."""

from __future__ import annotations

import copy
import pkgutil
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import fx, nn
from torch._inductor.custom_graph_pass import CustomGraphPass

from compiled.compilation.warm_up import once_per_shape
from compiled.passes.inline_references import inline_references
from compiled.compilation.split import (EAGER_BODIES, SPLITTING_OPS, SplitGraph, attach_fake_inputs, op_name,
                                        split_graph)
from compiled.forward_context import current_forward

# Incremented on every Inductor compilation this process runs; serving must leave it unchanged.
COMPILES = {"count": 0}


@dataclass
class CompileReport:
    pieces: int = 0
    unique: int = 0
    compiled: int = 0        # unique pieces compiled now (the rest came from an artifact)
    seconds: dict[str, float] = field(default_factory=dict)


class EagerSplitOp(nn.Module):
    """Stands in for a splitting op's submodule (every layer's is the same op): runs
    it, once per input shapes during warm_up_once, when its values do not matter. Its op calls
    go to the op's Python body where `EAGER_BODIES` names one, in a copy of the submodule's graph:
    the split's own submodule is left calling the op, as split_graph made it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = direct_calls(module)

    def forward(self, *args):
        return once_per_shape(EagerSplitOp, self.module, args)


def direct_calls(module: nn.Module) -> nn.Module:
    """`module` with its calls of the ops in `EAGER_BODIES` calling their bodies instead (a new
    graph module), or `module` itself where it calls none."""
    if not isinstance(module, fx.GraphModule):
        return module
    graph = copy.deepcopy(module.graph)
    swapped = False
    for node in graph.nodes:
        where = EAGER_BODIES.get(op_name(node.target)) if node.op == "call_function" else None
        if where is not None:
            node.target = pkgutil.resolve_name(where)
            swapped = True
    return fx.GraphModule(module, graph) if swapped else module


class CompiledPiece(nn.Module):
    """Stands in for a split submodule: calls the shared compiled function, or replays this
    piece's CUDA graph for the current bucket while piecewise graphs are active."""

    def __init__(self, fn: Callable, key: str, single_output: bool, weight_args: list[bool]) -> None:
        super().__init__()
        self.fn, self.key, self.single_output = fn, key, single_output
        self.weight_args = weight_args  # which positional inputs are weights (fixed addresses)
        self.graphs = None              # PieceGraphs once attached

    def forward(self, *args):
        mode = current_forward().piecewise
        if mode is None or self.graphs is None:
            out = once_per_shape(self.fn, self.fn, args, [not w for w in self.weight_args])
        else:
            out = self.graphs(args, mode)
        # A loaded artifact returns its outputs as a list even when the graph returns one tensor.
        return out[0] if self.single_output and isinstance(out, (list, tuple)) else out


class CompiledModel(nn.Module):
    """The split graph with compiled pieces; `lm_head` kept beside it as in the eager module."""

    def __init__(self, top: fx.GraphModule, lm_head: nn.Module, config) -> None:
        super().__init__()
        self.top, self.lm_head, self.config = top, lm_head, config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.top(input_ids, positions)

    @property
    def pieces(self) -> list[CompiledPiece]:
        """The compiled pieces in forward order."""
        modules = (getattr(self.top, n.target) for n in self.top.graph.nodes if n.op == "call_module")
        return [m for m in modules if isinstance(m, CompiledPiece)]


class _PieceKey(CustomGraphPass):
    """Rewrites nothing. Its uuid, the piece's key, joins the key of Inductor's FX-graph cache,
    which hashes the graph's code but not the schemas of the custom ops it calls: code generated
    for an op's old arguments (an earlier build of the project) is never reused."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, graph: fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return self.key


def compile_piece(graph: fx.GraphModule, fake_inputs: list, key: str):
    COMPILES["count"] += 1
    with torch._inductor.config.patch(post_grad_custom_post_pass=_PieceKey(key)):
        return torch._inductor.standalone_compile(graph, fake_inputs, dynamic_shapes="from_graph")


def compile_model(gm: nn.Module, device: torch.device, artifacts: dict[str, Callable] | None = None,
                  splitting_ops: tuple[str, ...] = SPLITTING_OPS) -> tuple[CompiledModel, dict, CompileReport]:
    """Split `gm` (materialised, weights loaded) at `splitting_ops` and compile its unique pieces,
    or take them from `artifacts` (key -> loaded callable). Returns the model, every compiled
    artifact by key, and the report."""
    report = CompileReport()
    start = time.perf_counter()
    split: SplitGraph = split_graph(gm, splitting_ops)
    report.seconds["split"] = time.perf_counter() - start
    unique = split.unique
    report.pieces, report.unique = len(split.pieces), len(unique)
    compiled: dict[str, Callable] = dict(artifacts or {})
    todo = [k for k in unique if k not in compiled]
    start = time.perf_counter()
    if todo:
        for key in todo:
            inline_references(unique[key].graph)
        attach_fake_inputs(split, device)
        for key in todo:
            piece = unique[key]
            compiled[key] = compile_piece(piece.graph, piece.fake_inputs, key)
            report.compiled += 1
    report.seconds["compile"] = time.perf_counter() - start
    calls = {n.target: n for n in split.top.graph.nodes if n.op == "call_module"}
    for name in calls.keys() - {p.name for p in split.pieces}:
        setattr(split.top, name, EagerSplitOp(getattr(split.top, name)))
    for piece in split.pieces:
        output = next(n for n in reversed(piece.graph.graph.nodes) if n.op == "output")
        single = not isinstance(output.args[0], (tuple, list))
        weight_args = [isinstance(a, fx.Node) and a.op == "get_attr" for a in calls[piece.name].args]
        setattr(split.top, piece.name, CompiledPiece(compiled[piece.key], piece.key, single, weight_args))
    return CompiledModel(split.top, gm.lm_head, gm.config), compiled, report
