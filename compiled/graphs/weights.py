"""Weights follow the graph: how each final parameter is built from checkpoint tensors.

The model defines the starting map (a parameter per checkpoint tensor, except that each MoE
layer keeps its experts stacked per projection); a fusing pass replaces several parameters by
one and records where each old piece lands (expert index, first row), so the loader can write
each checkpoint tensor straight into its slice of the final parameter."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

if TYPE_CHECKING:
    from compiled.quant.grid import ScaleGrid


@dataclass(frozen=True)
class Piece:
    source: str                 # checkpoint tensor name
    shape: tuple[int, ...]      # the shape that tensor must have
    expert: int | None = None   # index along a stacked expert dimension, None if not stacked
    row: int = 0                # first row (dim 0, after the expert index) that the source fills
    # (dim, start, length): the part of the source this rank reads (tensor parallelism); None: all
    narrow: tuple[int, int, int] | None = None
    # A block scale gathered onto a rank's grid (`quant/grid.py`); None: the source as it is
    grid: ScaleGrid | None = None

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of what the piece reads of its source."""
        if self.grid is not None:
            return self.grid.shape
        if self.narrow is None:
            return self.shape
        dim, _, length = self.narrow
        return self.shape[:dim] + (length,) + self.shape[dim + 1:]


@dataclass
class WeightMap:
    pieces: dict[str, list[Piece]]  # final parameter name -> the checkpoint tensors that build it
    # checkpoint tensors this graph does not read (another expert-parallel rank's experts)
    skipped: set[str] = field(default_factory=set)

    @classmethod
    def identity(cls, shapes: dict[str, tuple[int, ...]]) -> "WeightMap":
        return cls({name: [Piece(name, tuple(shape))] for name, shape in shapes.items()})

    def concat(self, target: str, members: list[tuple[str, int]]) -> None:
        """`target` becomes the row-wise concatenation of `members`, given as (parameter name,
        its number of rows; for expert stacks, rows of one expert); the members stop being
        parameters. One member is a rename."""
        row = 0
        built = self.pieces.setdefault(target, [])
        for name, rows in members:
            built += [replace(piece, row=row + piece.row) for piece in self.pieces.pop(name)]
            row += rows

    def shard(self, target: str, dim: int, start: int, length: int) -> None:
        """Each piece of `target` reads only `[start, start + length)` of its source along `dim`
        (before any fusing pass: one slice a source)."""
        self.pieces[target] = [replace(p, narrow=(dim, start, length)) for p in self.pieces[target]]

    def keep_experts(self, target: str, first: int, count: int) -> None:
        """`target` (an expert stack) keeps experts [first, first + count), renumbered from 0; the
        others' tensors are skipped."""
        kept = []
        for p in self.pieces[target]:
            if first <= p.expert < first + count:
                kept.append(replace(p, expert=p.expert - first))
            else:
                self.skipped.add(p.source)
        self.pieces[target] = kept

    def by_source(self) -> dict[str, tuple[str, Piece]]:
        return {p.source: (target, p) for target, pieces in self.pieces.items() for p in pieces}

    def describe(self, target: str) -> str:
        """A readable recipe, e.g. `qkv_proj.weight = cat(q_proj.weight, k_proj.weight, ...)`."""
        pieces = self.pieces[target]
        if len(pieces) == 1 and pieces[0].source == target:
            return target + (f" = {target}{_slice(pieces[0])}" if pieces[0].narrow is not None else "")
        experts = {p.expert for p in pieces}
        if experts != {None}:
            per = [p.source for p in pieces if p.expert == min(experts)]
            per = [p.source + _slice(p) for p in pieces if p.expert == min(experts)]
            return f"{target} = stack over {len(experts)} experts of cat({', '.join(per)})"
        return f"{target} = cat({', '.join(p.source + _slice(p) for p in pieces)})"

    def extract(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint tensors back out of `module`'s parameters (views, no copies)."""
        params = dict(module.named_parameters())
        for target, pieces in self.pieces.items():
            for piece in pieces:
                t = params[target] if piece.expert is None else params[target][piece.expert]
                yield piece.source, t.narrow(0, piece.row, piece.local_shape[0]) if t.dim() else t


def _slice(piece: Piece) -> str:
    """A piece's slice of its source, e.g. `[:, 64:128]`, or the scale blocks it gathers onto a
    rank's grid, e.g. `[1:3, 0:16 on 64x64]`."""
    if piece.grid is not None:
        rows, cols = (piece.grid.indices(d) for d in (0, 1))
        return f"[{rows[0]}:{rows[-1] + 1}, {cols[0]}:{cols[-1] + 1} on {piece.grid.fine[0]}x{piece.grid.fine[1]}]"
    if piece.narrow is None:
        return ""
    dim, start, length = piece.narrow
    return "[" + ", ".join([":"] * dim + [f"{start}:{start + length}"]) + "]"
