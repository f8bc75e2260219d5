"""What every graph pass shares: its record of changes and the helpers to rewrite call nodes."""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import operator
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import fx

from compiled.graphs.weights import WeightMap
from compiled.passes.calls import getitem_index, operands


@dataclass
class PassRecord:
    name: str
    nodes_before: int = 0
    nodes_after: int = 0
    rewrites: int = 0                                       # matches the pass rewrote
    params_created: list[str] = field(default_factory=list)
    params_removed: list[str] = field(default_factory=list)
    bytes_created: int = 0
    bytes_removed: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class GraphPass:
    """A named rewrite `fn(gm, weights, record)` that edits `gm` in place and fills `record`.
    `after` names the passes that must run before it when both are in a list (it matches what
    they leave); the manager rejects a list that breaks this."""
    name: str
    fn: Callable[[fx.GraphModule, WeightMap, PassRecord], None]
    after: tuple[str, ...] = ()

    @property
    def doc(self) -> str:
        """What the pass does: its module's docstring."""
        return inspect.getdoc(sys.modules[self.fn.__module__]) or ""

    @property
    def uuid(self) -> str:
        """A hash of the pass's source and of the helpers every pass shares: it joins the
        artifact's manifest, so a changed pass never meets code compiled for the old one."""
        return _source_hash(self.fn.__module__)


@functools.lru_cache(maxsize=None)
def _source_hash(module: str) -> str:
    digest = hashlib.sha256()
    for name in (module, __name__, "compiled.passes.calls", "compiled.passes.linear_fusion"):
        digest.update(inspect.getsource(importlib.import_module(name)).encode())
    return digest.hexdigest()[:16]


def sweep_dead_nodes(graph: fx.Graph) -> int:
    """Erase the nodes that nothing reads and that have no side effect (what a pass leaves behind:
    replaced calls, unused getitems), walking back from the output so that chains go in one sweep.
    fx's `eliminate_dead_code` does the same, but lints the whole graph first and asks every node
    whether it is impure; here each (op, target) is asked once. Returns how many were erased."""
    impure: dict[tuple, bool] = {}
    erased = 0
    for node in reversed(graph.nodes):
        if node.users or node.op in ("placeholder", "output"):
            continue
        key = (node.op, node.target)
        if key not in impure:
            impure[key] = node.is_impure()
        if not impure[key]:
            graph.erase_node(node)
            erased += 1
    return erased


def is_op(node: fx.Node, op) -> bool:
    """Whether `node` calls custom op `op` (traced as the packet or as its default overload)."""
    return node.op == "call_function" and node.target in (op, getattr(op, "default", None))


def is_getitem(node, index: int) -> bool:
    """Whether `node` is `source[index]` (one output of a node returning a tuple)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem \
        and getitem_index(node) == index


def is_module(gm: fx.GraphModule, node: fx.Node, kind: type) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), kind)


def param_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def note_params(record: PassRecord, created: dict[str, torch.Tensor], removed: dict[str, torch.Tensor]) -> None:
    record.params_created += list(created)
    record.params_removed += list(removed)
    record.bytes_created += sum(param_bytes(t) for t in created.values())
    record.bytes_removed += sum(param_bytes(t) for t in removed.values())


def is_add(node) -> bool:
    """Whether `node` is `a + b` of two graph values (a residual add)."""
    return is_call(node, operator.add, 2) and all(isinstance(a, fx.Node) for a in operands(node))


def match_rms_norm(node) -> tuple[fx.Node, fx.Node, float] | None:
    """(x, weight, eps) if `node` is the traced `layers.rms_norm(x, weight, eps)` (keep the two in step):
    weight * (h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) with h = x.float()."""
    if not is_call(node, operator.mul, 2):
        return None
    weight, cast = operands(node)
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and is_method(cast, "type_as", 2)):
        return None
    scaled, x = operands(cast)
    if not is_call(scaled, operator.mul, 2):
        return None
    h, rsqrt = operands(scaled)
    if not (is_method(h, "float", 1) and operands(h) == (x,) and is_call(rsqrt, torch.rsqrt, 1)):
        return None
    (add,) = operands(rsqrt)
    if not is_call(add, operator.add, 2) or not isinstance(operands(add)[1], float):
        return None
    mean, eps = operands(add)
    if not (is_method(mean, "mean", 2) and operands(mean)[1] == -1 and mean.kwargs == {"keepdim": True}):
        return None
    square = operands(mean)[0]
    if not (is_method(square, "pow", 2) and operands(square) == (h, 2)):
        return None
    return x, weight, eps


def is_call(node, target, nargs: int) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target \
        and len(operands(node)) == nargs


def is_method(node, name: str, nargs: int) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name \
        and len(operands(node)) == nargs
