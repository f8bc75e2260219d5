"""Split the passed graph into pieces at the attention ops, ready for Inductor.

1. Flatten: re-trace with no leaf modules, so every weight is a `get_attr` and every op a call.
2. Propagate fake tensors with a symbolic token count T (no 0/1 specialisation).
3. Split at each `compiled::attention` node (vLLM's piecewise scheme): attention stays eager.
4. Lift each piece's weights into inputs and rename its nodes canonically, so the pieces of
   identical layers are the same graph and compile once (48 layers -> a handful of graphs)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.split_module import split_module

from compiled.passes.base import is_op


class FlatTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False


def flatten(gm: nn.Module) -> fx.GraphModule:
    flat = fx.GraphModule(gm, FlatTracer().trace(gm), class_name="FlatGraph")
    flat.graph.eliminate_dead_code()
    flat.recompile()
    return flat


def symbolic_inputs(mode: FakeTensorMode, num_tokens: int, device: torch.device) -> list[torch.Tensor]:
    """Fake `input_ids` and `positions` whose length is one symbol shared by both."""
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC])
    ids = mode.from_tensor(torch.empty(num_tokens, dtype=torch.int64, device=device), symbolic_context=ctx)
    positions = mode.from_tensor(torch.empty(num_tokens, dtype=torch.int64, device=device), symbolic_context=ctx)
    torch._check(positions.shape[0] == ids.shape[0])
    return [ids, positions]


@dataclass
class Piece:
    """One compilable piece: a canonical graph whose inputs are activations and weights."""
    name: str                      # submodule name in the split graph
    graph: fx.GraphModule          # canonical node names, no attributes
    key: str                       # structural hash: pieces with equal keys compile once
    fake_inputs: list | None = None  # symbolic example inputs, set for the pieces that compile


@dataclass
class SplitGraph:
    top: fx.GraphModule            # calls submod_i in order; attention submodules stay eager
    pieces: list[Piece]

    @property
    def unique(self) -> dict[str, Piece]:
        out: dict[str, Piece] = {}
        for p in self.pieces:
            out.setdefault(p.key, p)
        return out


def split_at_attention(gm: nn.Module) -> SplitGraph:
    """Flatten and split; weights arrive in every piece as inputs (split_module lifts them)."""
    flat = flatten(gm)
    part, counter = {}, 0
    for node in flat.graph.nodes:
        if is_op(node, torch.ops.compiled.attention):
            part[node] = counter + 1
            counter += 2
        else:
            part[node] = counter
    top = split_module(flat, flat, lambda n: part[n], keep_original_order=True)
    pieces = []
    for node in top.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(top, node.target)
        if any(is_op(n, torch.ops.compiled.attention) for n in sub.graph.nodes):
            continue
        weights = [_fetch(top, a.target) if a.op == "get_attr" else None for a in node.args]
        pieces.append(_canonical(node.target, sub, weights))
    return SplitGraph(top, pieces)


def attach_fake_inputs(split: SplitGraph, device: torch.device, example_tokens: int = 8) -> None:
    """Symbolic example inputs (T dynamic, no 0/1 specialisation) for each unique piece, with
    every node's meta["val"] filled, as Inductor's standalone compile wants. Identical pieces
    are propagated once: later ones reuse the first one's outputs."""
    mode = FakeTensorMode(shape_env=ShapeEnv(specialize_zero_one=False), allow_non_fake_inputs=True)
    by_name = {p.name: p for p in split.pieces}
    outputs: dict[str, object] = {}
    env: dict = {}
    placeholders = iter(symbolic_inputs(mode, example_tokens, device))
    with mode:
        for node in split.top.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "get_attr":
                env[node] = mode.from_tensor(_fetch(split.top, node.target), static_shapes=True)
            elif node.op == "call_function":
                env[node] = node.target(*fx.node.map_arg(node.args, lambda a: env[a]), **node.kwargs)
            elif node.op == "call_module":
                args = [env[a] for a in node.args]
                piece = by_name.get(node.target)
                if piece is None:  # an attention submodule: one op, cheap to propagate
                    env[node] = FakeTensorProp(getattr(split.top, node.target), mode).propagate_dont_convert_inputs(*args)
                elif piece.key in outputs:
                    env[node] = outputs[piece.key]
                else:
                    piece.fake_inputs = args
                    env[node] = outputs[piece.key] = FakeTensorProp(piece.graph, mode).propagate_dont_convert_inputs(*args)
                    for n in piece.graph.graph.nodes:  # where Dynamo would have put it (AOT cache checks)
                        if "val" in n.meta:
                            n.meta["example_value"] = n.meta["val"]


def _canonical(name: str, sub: fx.GraphModule, weights: list[torch.Tensor | None]) -> Piece:
    """A copy of `sub` with inputs in0.. and nodes v0..; its key covers the code and the shapes
    and dtypes of the weight inputs (activations follow from the graph)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    count = 0
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            env[n] = graph.placeholder(f"in{len(env)}")
            continue
        if n.op == "get_attr":
            raise AssertionError(f"{name}: weights should arrive as inputs, found get_attr {n.target}")
        new = graph.node_copy(n, lambda a: env[a])
        if n.op != "output":
            new._rename(f"v{count}")
            count += 1
        env[n] = new
    canonical = fx.GraphModule(nn.Module(), graph, class_name="Piece")
    signature = canonical.code + repr([None if w is None else (tuple(w.shape), w.dtype) for w in weights])
    return Piece(name, canonical, hashlib.sha256(signature.encode()).hexdigest()[:16])


def _fetch(module: nn.Module, target: str) -> torch.Tensor:
    owner, _, attr = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, attr)
