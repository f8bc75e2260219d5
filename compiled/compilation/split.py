"""Split the passed graph into pieces at the splitting ops, ready for Inductor.

1. Flatten: re-trace with no leaf modules, so every weight is a `get_attr` and every op a call.
2. Split at each node that calls a splitting op (vLLM's piecewise scheme; by default
   `compiled::attention`, whose launch depends on the requests' lengths): those stay eager.
   Each piece takes its weights as inputs and has canonical node names, so the pieces of
   identical layers are the same graph and compile once (48 layers -> a handful of graphs).
3. Propagate fake tensors with a symbolic token count T (no 0/1 specialisation).

The split is built here rather than by torch.fx's `split_module`: that one builds and generates
code for a graph module per piece, all thrown away for the canonical copies. Inputs and outputs
are ordered as `split_module` orders them, which the piece keys (and saved artifacts) rely on."""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from compiled.graphs.trace import ModelTracer

# Ops the graph is split at (run eagerly between the compiled pieces), by qualified name.
SPLITTING_OPS: tuple[str, ...] = ("compiled::attention",)
# Splitting ops whose eager submodules call the op's Python body directly ("module:function"):
# nothing traces or compiles them there, and the dispatcher's round trip is host time between
# the pieces, which a prefill's time to first token waits on where the host sets the pace. Ops
# not named here go through the dispatcher.
EAGER_BODIES: dict[str, str] = {"compiled::attention": "compiled.attention.ops:attention_body"}


class FlatTracer(ModelTracer):
    """No leaf modules. Parameters are found through ModelTracer's table; buffers get one too,
    where fx would scan every buffer of the model at each use (once per layer for RoPE)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False

    def create_arg(self, a):
        if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter):
            if not hasattr(self, "_buffer_names"):
                self._buffer_names = {id(b): n for n, b in self.root.named_buffers()}
            name = self._buffer_names.get(id(a))
            if name is not None:
                return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)


def flatten(gm: fx.GraphModule) -> fx.Graph:
    """The graph with its remaining leaf modules (embedding, RoPE) inlined, so every weight is a
    `get_attr` of `gm` and every op a call. Each module call is traced on its own and spliced in,
    which is much cheaper than re-tracing the whole model; the nodes come out in the same order."""
    graph = fx.Graph()
    env: dict[fx.Node, object] = {}
    traces: dict[str, fx.Graph] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            env[node] = _inline(graph, gm, node, env, traces)
        elif node.op == "call_function" and node.target is operator.getitem and isinstance(env[node.args[0]], tuple):
            env[node] = env[node.args[0]][node.args[1]]  # a module returned a tuple: no getitem node
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.eliminate_dead_code()
    return graph


def _inline(graph: fx.Graph, gm: fx.GraphModule, call: fx.Node, env: dict, traces: dict[str, fx.Graph]) -> object:
    """Copy the flat trace of the module `call` runs into `graph`; returns what it outputs
    (a node, or a tuple of nodes). Modules alike in `_signature` share one trace (48 RoPEs)."""
    module = gm.get_submodule(call.target)
    signature = _signature(module)
    sub = traces.get(signature)
    if sub is None:
        sub = traces[signature] = FlatTracer().trace(module)
    params = [n for n in sub.nodes if n.op == "placeholder"]
    args = list(call.args) + [call.kwargs[p.target] for p in params[len(call.args):]]
    local: dict[fx.Node, object] = {p: env[a] if isinstance(a, fx.Node) else a for p, a in zip(params, args)}
    result = None
    for node in sub.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            result = fx.node.map_arg(node.args[0], local.__getitem__)
        elif node.op == "get_attr":
            local[node] = graph.get_attr(f"{call.target}.{node.target}")
        else:
            local[node] = graph.node_copy(node, local.__getitem__)
    return result


def _signature(module: nn.Module) -> str:
    """What a module's trace depends on: its class, plain attributes and tensor shapes (get_attr
    targets are relative to the module, so equal signatures trace to equal graphs)."""
    plain = {k: v for k, v in vars(module).items() if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module))}
    tensors = [(n, tuple(t.shape), t.dtype) for n, t in (*module.named_parameters(), *module.named_buffers())]
    return repr((type(module).__qualname__, type(module).__module__, sorted(plain.items()), tensors))


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
    top: fx.GraphModule            # calls submod_i in order; splitting-op submodules stay eager
    pieces: list[Piece]

    @property
    def unique(self) -> dict[str, Piece]:
        out: dict[str, Piece] = {}
        for p in self.pieces:
            out.setdefault(p.key, p)
        return out


def split_graph(gm: nn.Module, splitting_ops: tuple[str, ...] = SPLITTING_OPS) -> SplitGraph:
    """Flatten and split at `splitting_ops`; weights arrive in every piece as inputs. The top
    graph calls the splitting ops' submodules eagerly and the pieces until compile_model puts
    compiled ones there."""
    flat = flatten(gm)
    parts = _partition(flat, frozenset(splitting_ops))
    modules: dict[str, nn.Module] = {}
    pieces: list[Piece] = []
    keys: dict[tuple, str] = {}
    for part in parts:
        graph = _canonical_graph(part)
        if part.splits:
            modules[part.name] = fx.GraphModule({}, graph)
        else:
            weights = [_fetch(gm, n.target) if n.op == "get_attr" else None for n in part.inputs]
            pieces.append(_piece(part.name, graph, weights, keys))
            modules[part.name] = pieces[-1].graph
    return SplitGraph(_top_graph(gm, flat, parts, modules), pieces)


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
                if piece is None:  # a splitting op's submodule: one op, cheap to propagate
                    env[node] = FakeTensorProp(getattr(split.top, node.target), mode).propagate_dont_convert_inputs(*args)
                elif piece.key in outputs:
                    env[node] = outputs[piece.key]
                else:
                    piece.fake_inputs = args
                    env[node] = outputs[piece.key] = FakeTensorProp(piece.graph, mode).propagate_dont_convert_inputs(*args)
                    for n in piece.graph.graph.nodes:  # where Dynamo would have put it (AOT cache checks)
                        if "val" in n.meta:
                            n.meta["example_value"] = n.meta["val"]


@dataclass
class _Part:
    """A run of nodes between splitting ops, or one splitting op: submod_{index} of the split."""
    index: int
    splits: bool
    nodes: list[fx.Node] = field(default_factory=list)
    inputs: dict[fx.Node, None] = field(default_factory=dict)   # ordered: first use first
    outputs: dict[fx.Node, None] = field(default_factory=dict)  # ordered: first use elsewhere first

    @property
    def name(self) -> str:
        return f"submod_{self.index}"


def _partition(flat: fx.Graph, splitting_ops: frozenset[str]) -> list[_Part]:
    """Numbered as split_module numbers the parts (0, split 1, 2, split 3, ...); inputs
    and outputs in the order split_module finds them, walking the nodes' arguments in order."""
    parts: dict[int, _Part] = {}
    owner: dict[fx.Node, _Part] = {}
    counter = 0
    for node in flat.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        user = None
        if node.op != "output":
            splits = node.op == "call_function" and op_name(node.target) in splitting_ops
            index = counter + 1 if splits else counter
            if splits:
                counter += 2
            if index not in parts:
                parts[index] = _Part(index, splits)
            user = owner[node] = parts[index]
            user.nodes.append(node)
        for arg in node.all_input_nodes:
            source = owner.get(arg)  # None: a placeholder or a weight
            if source is not user:
                if source is not None:
                    source.outputs.setdefault(arg)
                if user is not None:
                    user.inputs.setdefault(arg)
    return list(parts.values())


def _canonical_graph(part: _Part) -> fx.Graph:
    """The part's nodes with inputs named in0.. and the rest v0..: names do not depend on where
    in the model the part sits, so identical layers give identical graphs (and code)."""
    graph = fx.Graph()
    env = {node: graph.placeholder(f"in{i}") for i, node in enumerate(part.inputs)}
    for i, node in enumerate(part.nodes):
        env[node] = graph.create_node(node.op, node.target, fx.node.map_arg(node.args, env.__getitem__),
                                      fx.node.map_arg(node.kwargs, env.__getitem__), name=f"v{i}",
                                      type_expr=node.type)
        env[node].meta = node.meta.copy()
    outputs = [env[node] for node in part.outputs]
    graph.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
    return graph


def _piece(name: str, graph: fx.Graph, weights: list[torch.Tensor | None], keys: dict[tuple, str]) -> Piece:
    """The key hashes the piece's code and the shapes and dtypes of its weight inputs
    (activations follow from the graph). Code generation is slow, so it runs once per structure:
    the code follows from each node's op, target, arguments and type (the names are canonical).
    The module itself generates code lazily, only if it is ever run: the compiled function
    takes its place."""
    module = _LazyGraphModule(nn.Module(), graph, class_name="Piece")
    shapes = repr([None if w is None else (tuple(w.shape), w.dtype) for w in weights])
    structure = (shapes, *((n.op, n.target, repr(n.args), repr(n.kwargs), n.type) for n in graph.nodes))
    if structure not in keys:
        keys[structure] = hashlib.sha256((module.code + shapes + _op_schemas(graph)).encode()).hexdigest()[:16]
    return Piece(name, module, keys[structure])


def _op_schemas(graph: fx.Graph) -> str:
    """The schemas of the project's ops the piece calls: its code names them, but code compiled
    for an op's old arguments must not be found by the key (an artifact, Inductor's cache)."""
    return "\n".join(sorted({str(n.target._schema) for n in graph.nodes if n.op == "call_function"
                             and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "compiled"}))


def _top_graph(gm: nn.Module, flat: fx.Graph, parts: list[_Part], modules: dict[str, nn.Module]) -> fx.GraphModule:
    """Calls the parts in order, as split_module's top graph does: the inputs, then per part
    the weights it is first to read, its call, and one getitem per output when it has several."""
    graph = fx.Graph()
    attrs: dict[str, object] = dict(modules)
    env: dict[fx.Node, fx.Node] = {}
    for node in flat.find_nodes(op="placeholder"):
        env[node] = graph.placeholder(node.target, type_expr=node.type)
        env[node].meta = node.meta.copy()
    for part in parts:
        for node in part.inputs:
            if node.op == "get_attr" and node not in env:
                env[node] = graph.get_attr(node.target)
                env[node].meta = node.meta.copy()
                attrs[node.target] = _fetch(gm, node.target)
        call = graph.call_module(part.name, tuple(env[n] for n in part.inputs))
        if len(part.outputs) == 1:
            env[next(iter(part.outputs))] = call
        else:
            for i, node in enumerate(part.outputs):
                env[node] = graph.call_function(operator.getitem, (call, i))
    output = flat.output_node()
    graph.output(fx.node.map_arg(output.args[0], env.__getitem__))
    return fx.GraphModule(attrs, graph)


def _fetch(module: nn.Module, target: str) -> torch.Tensor:
    owner, _, attr = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, attr)


def op_name(target) -> str | None:
    """'namespace::name' of a custom op (its packet or an overload), None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return target.name().split(".")[0]
    return getattr(target, "_qualified_op_name", None)
