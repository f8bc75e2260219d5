"""Scales follow the weights: the recipe of each FP8 parameter's scale, derived from the weight's.

A fused parameter (qkv, w13, stacked experts) concatenates its members' rows; its scale
concatenates their scale rows the same way (block scales along the output dim), which is exact
only where each member starts on a block boundary of the fused parameter. A parameter whose
members do not (block 128 over a 64-row q_proj, or several per-tensor scales in one fused weight)
has no single block grid: it is listed apart, to be loaded dequantized in the engine dtype."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from compiled.graphs.weights import Piece, WeightMap
from compiled.quant.config import QuantConfig
from compiled.quant.dequant import resolve_block


@dataclass
class ScaleRecipes:
    scales: WeightMap                                        # `<parameter>_scale` -> checkpoint scales
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # each scale parameter's shape
    dequantized: set[str] = field(default_factory=set)       # FP8 sources of parameters kept dequantized


def _rows(pieces: list[Piece]) -> int:
    """Rows of the parameter (of one expert, for a stack) that `pieces` fill."""
    return max(p.row + p.shape[0] for p in pieces)


def scale_recipes(weights: WeightMap, quant: QuantConfig) -> ScaleRecipes:
    """Every parameter all of whose checkpoint tensors are FP8 weights gets a scale parameter
    `<name>_scale` (block grid `quant.op_block`) built from their scales, where the grid allows."""
    out = ScaleRecipes(WeightMap({}))
    for target, pieces in weights.pieces.items():
        fp8 = [quant.quantizes(p.source.rpartition(".")[0]) and p.source.endswith(".weight") for p in pieces]
        if not any(fp8):
            continue
        rows, cols = _rows(pieces), pieces[0].shape[1]
        bo, bi = resolve_block(quant.op_block, rows, cols)
        aligned = all(fp8) and all(p.row % bo == 0 and (p.row + p.shape[0] == rows or (p.row + p.shape[0]) % bo == 0)
                                   for p in pieces)
        if not aligned:
            out.dequantized.update(p.source for p, q in zip(pieces, fp8) if q)
            continue
        module = lambda p: p.source.rpartition(".")[0]  # noqa: E731
        out.scales.pieces[f"{target}_scale"] = [
            replace(p, source=f"{module(p)}.{quant.scale_suffix}", shape=quant.scale_shape(*p.shape), row=p.row // bo)
            for p in pieces]
        experts = {p.expert for p in pieces} - {None}
        grid = (-(-rows // bo), -(-cols // bi))
        out.shapes[f"{target}_scale"] = (len(experts), *grid) if experts else grid
    return out
