"""Quantize at load: `quantization="fp8"` turns an unquantized checkpoint into block FP8 (128 x 128
blocks, as Qwen publishes) while it streams in, one tensor at a time, so no full-precision copy of
the model is ever held; with dummy weights it gives FP8 weights in the real shapes. Under tensor
parallelism each rank reads and quantizes only the blocks its slices touch (`rank_parts`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from compiled.errors import ConfigError
from compiled.graphs.config import ModelConfig
from compiled.graphs.weights import Piece, WeightMap
from compiled.quant.config import QuantConfig

METHODS = {"fp8": QuantConfig("fp8", "block", (128, 128))}


@dataclass(frozen=True)
class Part:
    """The whole blocks of a checkpoint weight that a rank quantizes: `length` along `dim` from
    `start`, of a weight of `shape`."""
    dim: int
    start: int
    length: int
    shape: tuple[int, ...]

    @property
    def part_shape(self) -> tuple[int, ...]:
        return self.shape[:self.dim] + (self.length,) + self.shape[self.dim + 1:]


def with_quantization(cfg: ModelConfig, quantization: str | None) -> tuple[ModelConfig, bool]:
    """(the config the model is built from, whether its weights are quantized while loading). A
    checkpoint that is FP8 already loads as it is."""
    if quantization is None or cfg.quantization is not None:
        return cfg, False
    if quantization not in METHODS:
        raise ConfigError(f"quantization={quantization!r}: expected None or one of {', '.join(METHODS)}")
    return replace(cfg, quantization=METHODS[quantization]), True


def rank_parts(weights: WeightMap, keep: set[str], quant: QuantConfig) -> tuple[WeightMap, dict[str, Part]]:
    """Under tensor parallelism a rank quantizes, of each weight it keeps FP8 (`keep`), only the
    whole blocks its slice touches: the same blocks as in the whole tensor, so the same FP8
    values and scales. (the weight map with those weights' and scales' pieces rebased onto that
    part, checkpoint name -> its part)."""
    parts: dict[str, Part] = {}
    for piece in (p for pieces in weights.pieces.values() for p in pieces):
        if piece.source in keep and piece.narrow is not None:
            dim, start, length = piece.narrow
            block = quant.block[dim]
            first, end = start // block * block, min(-(-(start + length) // block) * block, piece.shape[dim])
            parts[piece.source] = Part(dim, first, end - first, piece.shape)
    if not parts:
        return weights, parts
    return WeightMap({t: [_rebased(p, parts, quant) for p in ps] for t, ps in weights.pieces.items()}), parts


def _rebased(piece: Piece, parts: dict[str, Part], quant: QuantConfig) -> Piece:
    module, _, leaf = piece.source.rpartition(".")
    part = parts.get(f"{module}.weight")
    if part is None or leaf not in ("weight", quant.scale_suffix):
        return piece
    if leaf == "weight":
        _, start, length = piece.narrow
        return replace(piece, shape=part.part_shape, narrow=(part.dim, start - part.start, length))
    grid = piece.grid   # a sliced weight's scale always has one (`quant/recipes.py`)
    span = (grid.rows, grid.cols)[part.dim]
    moved = {("rows", "cols")[part.dim]: (span[0] - part.start, span[1])}
    return replace(piece, shape=quant.scale_shape(*part.part_shape), grid=replace(grid, **moved))
