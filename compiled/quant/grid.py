"""A rank's block scales on its own grid: the checkpoint's scale blocks cut to the rows and
columns of the weight slice the rank holds.

A tensor-parallel slice need not start on a scale block (30B's 768-wide experts are 192 a rank at
TP=4, inside a 128 block), and a fused parameter of slices (w13: the rank's gate rows, then its
up rows) need not keep one block phase. The rank's scale therefore lives on a finer grid whose
block divides the checkpoint's and every slice start (`local_block`): each fine block lies inside
one checkpoint block, so the fine scale is a gather of the checkpoint scale (`ScaleGrid.take`),
reading only the blocks the slice touches, and the ops keep their one `weight_block` operand."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class ScaleGrid:
    """How one checkpoint scale becomes its piece of a rank's scale parameter. Sides of 0 span the
    whole dim (per channel, per tensor), as in `weight_block`."""
    block: tuple[int, int]   # the checkpoint's block
    fine: tuple[int, int]    # the rank's block (divides `block` and the slice's start)
    rows: tuple[int, int]    # (start, length) of the rank's rows of the source weight
    cols: tuple[int, int]    # (start, length) of its columns

    def indices(self, dim: int) -> list[int]:
        """The checkpoint block of each fine block along `dim` (0: rows, 1: columns)."""
        block, fine, (start, length) = self.block[dim], self.fine[dim], (self.rows, self.cols)[dim]
        if block == 0:
            return [0]
        return [(start + j * fine) // block for j in range(math.ceil(length / fine))]

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.indices(0)), len(self.indices(1))

    def take(self, scale: torch.Tensor) -> torch.Tensor:
        """The fine scale of the rank's slice from the checkpoint's `scale` (a per-tensor one is
        stored as one element)."""
        s = scale.reshape(-1, 1) if scale.dim() == 1 else scale
        rows, cols = (torch.tensor(self.indices(d), device=s.device) for d in (0, 1))
        return s.index_select(0, rows).index_select(1, cols)


def local_block(block: tuple[int, int], row_starts: Iterable[int], col_starts: Iterable[int]) -> tuple[int, int]:
    """The coarsest block that divides `block` and puts a boundary at every start (slice starts in
    their sources, member starts in fused parameters); a side of 0 (the whole dim) stays 0."""
    bo, bi = block
    for start in row_starts:
        bo = math.gcd(bo, start) if bo else 0
    for start in col_starts:
        bi = math.gcd(bi, start) if bi else 0
    return bo, bi
