"""Scales follow the weights: the recipe of each FP8 parameter's scale, derived from the weight's.

A fused parameter (qkv, w13, stacked experts) concatenates its members' rows; its scale
concatenates their scale rows the same way (block scales along the output dim), which is exact
only where each member starts on a block boundary of the fused parameter. A parameter whose
members do not (block 128 over a 64-row q_proj, or several per-tensor scales in one fused weight)
has no single block grid: it is listed apart, to be loaded dequantized in the engine dtype.
Under tensor parallelism the block is the rank's (`quant/grid.py`): one that every slice start
and member start of the rank falls on, so its sharded parameters keep their FP8 weights."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from compiled.graphs.weights import Piece, WeightMap
from compiled.quant.config import QuantConfig
from compiled.quant.dequant import resolve_block
from compiled.quant.grid import ScaleGrid, local_block


@dataclass
class ScaleRecipes:
    scales: WeightMap                                        # `<parameter>_scale` -> checkpoint scales
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # each scale parameter's shape
    dequantized: set[str] = field(default_factory=set)       # FP8 sources of parameters kept dequantized
    block: tuple[int, int] = (0, 0)                          # the ops' weight_block: the grid of every scale


def _rows(pieces: list[Piece]) -> int:
    """Rows of the parameter (of one expert, for a stack) that `pieces` fill."""
    return max(p.row + p.local_shape[0] for p in pieces)


def _span(piece: Piece, dim: int) -> tuple[int, int]:
    """(start, length) of what `piece` reads of its source along `dim`."""
    if piece.narrow is not None and piece.narrow[0] == dim:
        return piece.narrow[1:]
    return 0, piece.shape[dim]


def _is_fp8(quant: QuantConfig, piece: Piece) -> bool:
    return quant.quantizes(piece.source.rpartition(".")[0]) and piece.source.endswith(".weight")


def rank_block(weights: WeightMap, quant: QuantConfig) -> tuple[int, int]:
    """The block of every scale of this rank's model: the checkpoint's, or under tensor
    parallelism (some piece narrowed) the coarsest one every slice and member start falls on.
    Slices are rank x length, so dividing the lengths puts every rank on the same grid (one
    graph for all ranks)."""
    pieces = [p for ps in weights.pieces.values() for p in ps if _is_fp8(quant, p)]
    if all(p.narrow is None for p in pieces):
        return quant.op_block
    return local_block(quant.op_block, [p.row for p in pieces] + _cuts(pieces, 0), _cuts(pieces, 1))


def _cuts(pieces: list[Piece], dim: int) -> list[int]:
    """The starts and lengths of the slices along `dim`."""
    return [n for p in pieces if p.narrow is not None and p.narrow[0] == dim for n in p.narrow[1:]]


def _scale_piece(piece: Piece, quant: QuantConfig, block: tuple[int, int], bo: int) -> Piece:
    """The scale's piece beside weight `piece` (its checkpoint scale, gathered onto `block` when
    that is not the checkpoint's or the weight is a slice)."""
    scale = replace(piece, source=f"{piece.source.rpartition('.')[0]}.{quant.scale_suffix}",
                    shape=quant.scale_shape(*piece.shape), row=piece.row // bo, narrow=None)
    if piece.narrow is None and block == quant.op_block:
        return scale
    return replace(scale, grid=ScaleGrid(quant.op_block, block, _span(piece, 0), _span(piece, 1)))


def scale_recipes(weights: WeightMap, quant: QuantConfig) -> ScaleRecipes:
    """Every parameter all of whose checkpoint tensors are FP8 weights gets a scale parameter
    `<name>_scale` (block grid `ScaleRecipes.block`) built from their scales, where the grid allows."""
    block = rank_block(weights, quant)
    out = ScaleRecipes(WeightMap({}), block=block)
    for target, pieces in weights.pieces.items():
        fp8 = [_is_fp8(quant, p) for p in pieces]
        if not any(fp8):
            continue
        rows, cols = _rows(pieces), pieces[0].local_shape[1]
        bo, bi = resolve_block(block, rows, cols)
        aligned = all(fp8) and all(p.row % bo == 0 and (p.row + p.local_shape[0] == rows
                                                        or (p.row + p.local_shape[0]) % bo == 0) for p in pieces)
        if not aligned:
            out.dequantized.update(p.source for p, q in zip(pieces, fp8) if q)
            continue
        out.scales.pieces[f"{target}_scale"] = [_scale_piece(p, quant, block, bo) for p in pieces]
        experts = {p.expert for p in pieces} - {None}
        grid = (-(-rows // bo), -(-cols // bi))
        out.shapes[f"{target}_scale"] = (len(experts), *grid) if experts else grid
    return out
