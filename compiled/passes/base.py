"""What every graph pass shares: its record of changes and the helpers to rewrite call nodes."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import fx

from compiled.graphs.weights import WeightMap


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


@dataclass
class GraphPass:
    """A named rewrite `fn(gm, weights, record)` that edits `gm` in place and fills `record`."""
    name: str
    fn: Callable[[fx.GraphModule, WeightMap, PassRecord], None]


def is_op(node: fx.Node, op) -> bool:
    """Whether `node` calls custom op `op` (traced as the packet or as its default overload)."""
    return node.op == "call_function" and node.target in (op, getattr(op, "default", None))


def is_getitem(node, index: int) -> bool:
    """Whether `node` is `source[index]` (one output of a node returning a tuple)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem \
        and node.args[1] == index


def is_module(gm: fx.GraphModule, node: fx.Node, kind: type) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), kind)


def param_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def note_params(record: PassRecord, created: dict[str, torch.Tensor], removed: dict[str, torch.Tensor]) -> None:
    record.params_created += list(created)
    record.params_removed += list(removed)
    record.bytes_created += sum(param_bytes(t) for t in created.values())
    record.bytes_removed += sum(param_bytes(t) for t in removed.values())
