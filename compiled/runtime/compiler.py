"""Inductor for the pieces: each unique piece is compiled once for a symbolic token count.

Compilation goes through `torch._inductor.standalone_compile` on our own graphs (no Dynamo
guessing, so no guards and nothing that can recompile later). Every compile is counted: after
warm-up the count must not move, and a test asserts it."""

from __future__ import annotations

import contextlib
import operator
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import fx, nn

from compiled.passes.base import is_op
from compiled.runtime.piecewise import SplitGraph, attach_fake_inputs, split_at_attention
from compiled.runtime.piecewise_graphs import current_mode

# Incremented on every Inductor compilation this process runs; serving must leave it unchanged.
COMPILES = {"count": 0}


@dataclass
class CompileReport:
    pieces: int = 0
    unique: int = 0
    compiled: int = 0        # unique pieces compiled now (the rest came from an artifact)
    seconds: dict[str, float] = field(default_factory=dict)


# While set (see warm_up_once): outputs of the first call per (function, input shapes).
_warm_outputs: dict | None = None


@contextlib.contextmanager
def warm_up_once() -> Iterator[None]:
    """A forward run only for its side effects (Triton compiles, autotuning, workspace
    allocation before a capture; the piecewise capture itself): identical layers share code and
    shapes, so each compiled function, and attention, runs once per input shape and later
    layers return those outputs."""
    global _warm_outputs
    previous, _warm_outputs = _warm_outputs, {}
    try:
        yield
    finally:
        _warm_outputs = previous


def _once_per_shape(kind: object, run: Callable, args: tuple, activations: list[bool] | None = None):
    """`run(*args)`; during warm_up_once, the outputs of the first call of this `kind` with these
    shapes of the activations (every tensor argument when `activations` is None)."""
    if _warm_outputs is None:
        return run(*args)
    shapes = tuple(tuple(a.shape) for i, a in enumerate(args)
                   if isinstance(a, torch.Tensor) and (activations is None or activations[i]))
    key = (kind, shapes)
    if key not in _warm_outputs:
        _warm_outputs[key] = run(*args)
    return _warm_outputs[key]


class EagerAttention(nn.Module):
    """Stands in for an attention submodule of the split (every layer's is the same op): runs
    it, once per input shapes during warm_up_once, when its values do not matter."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args):
        return _once_per_shape(EagerAttention, self.module, args)


class CompiledPiece(nn.Module):
    """Stands in for a split submodule: calls the shared compiled function, or replays this
    piece's CUDA graph for the current bucket while piecewise graphs are active."""

    def __init__(self, fn: Callable, key: str, single_output: bool, weight_args: list[bool]) -> None:
        super().__init__()
        self.fn, self.key, self.single_output = fn, key, single_output
        self.weight_args = weight_args  # which positional inputs are weights (fixed addresses)
        self.graphs = None              # PieceGraphs once attached

    def forward(self, *args):
        mode = current_mode()
        if mode is None or self.graphs is None:
            out = _once_per_shape(self.fn, self.fn, args, [not w for w in self.weight_args])
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


def inline_references(graph: fx.GraphModule) -> None:
    """Put the torch reference in place of ops that have no kernel of their own, so Inductor
    fuses them instead of calling them opaquely (silu_and_mul: one fused pointwise kernel rather
    than eager silu and mul). Runs before fake propagation; piece keys are taken before it."""
    for node in list(graph.graph.nodes):
        if not is_op(node, torch.ops.compiled.silu_and_mul):
            continue
        with graph.graph.inserting_before(node):
            halves = graph.graph.call_function(torch.chunk, (node.args[0], 2, -1))
            gate = graph.graph.call_function(operator.getitem, (halves, 0))
            up = graph.graph.call_function(operator.getitem, (halves, 1))
            act = graph.graph.call_function(F.silu, (gate,))
            fused = graph.graph.call_function(operator.mul, (act, up))
        node.replace_all_uses_with(fused)
        graph.graph.erase_node(node)
    graph.recompile()


def compile_piece(graph: fx.GraphModule, fake_inputs: list):
    COMPILES["count"] += 1
    return torch._inductor.standalone_compile(graph, fake_inputs, dynamic_shapes="from_graph")


def compile_model(gm: nn.Module, device: torch.device,
                  artifacts: dict[str, Callable] | None = None) -> tuple[CompiledModel, dict, CompileReport]:
    """Split `gm` (materialised, weights loaded) and compile its unique pieces, or take them from
    `artifacts` (key -> loaded callable). Returns the model, every compiled artifact by key, and
    the report."""
    report = CompileReport()
    start = time.perf_counter()
    split: SplitGraph = split_at_attention(gm)
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
            compiled[key] = compile_piece(piece.graph, piece.fake_inputs)
            report.compiled += 1
    report.seconds["compile"] = time.perf_counter() - start
    calls = {n.target: n for n in split.top.graph.nodes if n.op == "call_module"}
    for name in calls.keys() - {p.name for p in split.pieces}:
        setattr(split.top, name, EagerAttention(getattr(split.top, name)))
    for piece in split.pieces:
        output = next(n for n in reversed(piece.graph.graph.nodes) if n.op == "output")
        single = not isinstance(output.args[0], (tuple, list))
        weight_args = [isinstance(a, fx.Node) and a.op == "get_attr" for a in calls[piece.name].args]
        setattr(split.top, piece.name, CompiledPiece(compiled[piece.key], piece.key, single, weight_args))
    return CompiledModel(split.top, gm.lm_head, gm.config), compiled, report
