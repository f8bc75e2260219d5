"""Dequantization references: W = fp8 x scale, block by block, per channel or per tensor.

Computed in float64 (a float8 value times an fp32 scale needs more than fp32's mantissa to be
exact), then cast to the dtype asked for; the oracle and the CPU path share these functions."""

from __future__ import annotations

from typing import NamedTuple

import torch

from compiled.quant.config import QuantConfig

FP8 = torch.float8_e4m3fn


class WeightScale(NamedTuple):
    """An FP8 weight's block scale `[ceil(N/bo), ceil(K/bi)]` and its block [bo, bi] (0: the whole
    dim), as the linear kernels take it beside the weight."""
    scale: torch.Tensor
    block: list[int]


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A `[..., ceil(rows/bo), ceil(cols/bi)]` block scale repeated to `[..., rows, cols]` (edge
    blocks cut)."""
    bo, bi = block
    return scale.repeat_interleave(bo, -2)[..., :rows, :].repeat_interleave(bi, -1)[..., :cols]


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | list[int],
                      dtype: torch.dtype) -> torch.Tensor:
    """`weight [..., N, K]` (fp8) times its `[..., ceil(N/bo), ceil(K/bi)]` scale, in `dtype`. A
    block side of 0 spans the whole dim: a scale per output channel is the block (1, 0), one per
    tensor (0, 0), so one block value serves weights of every shape."""
    rows, cols = weight.shape[-2:]
    full = expand_block_scale(scale.to(torch.float64), rows, cols, resolve_block(block, rows, cols))
    return (weight.to(torch.float64) * full).to(dtype)


# How an FP8 kernel applies a block scale to its weight tiles (its FP8 constexpr; 0: no scale):
FP8_GATHER = 1   # a scale gathered per element: any block, any tiling
FP8_BLOCKS = 2   # one scale per row and scale block the tile covers, loaded once a tile
# W8A8: FP8_BLOCKS' tiles (each inside one scale block) times activations quantized to FP8 per
# token in groups of the block's width (`quant.act_quant`), the K step's fp8 x fp8 product scaled
# by the row's group scale and the weight row's block scale (the fused MoE's grouped GEMMs)
FP8_W8A8 = 3
# W8A8 whose N tiles each lie inside one scale block along the weight's rows: one weight scale a
# tile and K step, so a step's product is scaled by one factor a row (one FMA an element)
FP8_W8A8_TILE = 4


def scale_tiling(bi: int, block_k: int, many: bool = True) -> tuple[int, int]:
    """(FP8 mode, KB) for K tiles `block_k` wide, each starting at a multiple of `block_k`, over
    scale blocks `bi` wide: FP8_BLOCKS with KB = 1 where every tile lies inside one block, with
    KB = block_k / bi where it covers whole blocks (kernels that take `many`), else FP8_GATHER."""
    if bi % block_k == 0:
        return FP8_BLOCKS, 1
    if many and block_k % bi == 0:
        return FP8_BLOCKS, block_k // bi
    return FP8_GATHER, 1


class KernelScale(NamedTuple):
    """A block scale as a Triton kernel takes it for its weight tiles: the scale (contiguous), the
    block's sides (no zeros) and the FP8 mode and KB of `scale_tiling`."""
    scale: torch.Tensor
    bo: int
    bi: int
    mode: int
    kb: int


def kernel_scale(scale: torch.Tensor, block: tuple[int, int] | list[int], rows: int, cols: int, block_k: int,
                 many: bool = True) -> KernelScale:
    """`scale` of a `[..., rows, cols]` FP8 weight at `block`, for a kernel reading K tiles of
    `block_k` (`many`: its tiles may cover several blocks)."""
    bo, bi = resolve_block(block, rows, cols)
    return KernelScale(scale.contiguous(), bo, bi, *scale_tiling(bi, block_k, many))


def fit_block_k(bi: int, block_k: int) -> int:
    """A K tile up to `block_k`, halved (not below tl.dot's 16) until it divides the scale block
    `bi`, so that each tile takes one scale per weight row."""
    while bi % block_k and block_k > 16:
        block_k //= 2
    return block_k


def resolve_block(block: tuple[int, int] | list[int], rows: int, cols: int) -> tuple[int, int]:
    """The block's sides for a `[rows, cols]` weight (0: the whole dim)."""
    return (block[0] or rows, block[1] or cols)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, quant: QuantConfig,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The `[rows, cols]` weight an FP8 `weight` and its checkpoint `scale` stand for, in `dtype`."""
    rows, cols = weight.shape
    bo, bi = resolve_block(quant.op_block, rows, cols)
    return dequantize_blocks(weight, scale.reshape(-(-rows // bo), -(-cols // bi)), (bo, bi), dtype)


def scaled_weight(op: str, name: str, weight: torch.Tensor, scale: torch.Tensor | None,
                  block: list[int] | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight an op computes with: `weight` itself, or with its scale operand (the torch
    reference of an FP8 weight) the dequantized weight in the activations' dtype."""
    if scale is None:
        if block is not None:
            raise ValueError(f"{op}: weight_block without {name}")
        return weight
    check_scale(op, name, weight, scale, block)
    return dequantize_blocks(weight, scale, block, dtype)


def check_scale(op: str, name: str, weight: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> None:
    """`scale` fits `weight` (fp8) at `block`, else a ValueError naming the op and the operand."""
    if block is None or len(block) != 2 or min(block) < 0:
        raise ValueError(f"{op}: {name} needs weight_block, two ints >= 0, got {block!r}")
    if weight.dtype != FP8:
        raise ValueError(f"{op}: {name} given for a weight of dtype {weight.dtype}, not float8_e4m3fn")
    rows, cols = weight.shape[-2:]
    bo, bi = resolve_block(block, rows, cols)
    expected = (*weight.shape[:-2], -(-rows // bo), -(-cols // bi))
    if tuple(scale.shape) != expected:
        raise ValueError(f"{op}: {name} has shape {list(scale.shape)}, expected {list(expected)} for weight "
                         f"{list(weight.shape)} at block {list(block)}")


def quantize(weight: torch.Tensor, quant: QuantConfig, scale_dtype: torch.dtype = torch.float32
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale) with each block's / row's / the tensor's largest magnitude at fp8's
    largest finite value, so that `dequantize` inverts it up to fp8 rounding."""
    w = weight.to(torch.float32)
    rows, cols = w.shape
    if quant.scheme == "block":
        bo, bi = quant.block
        nr, nc = -(-rows // bo), -(-cols // bi)
        padded = torch.zeros(nr * bo, nc * bi, dtype=torch.float32, device=w.device)
        padded[:rows, :cols] = w
        amax = padded.view(nr, bo, nc, bi).abs().amax(dim=(1, 3))
    elif quant.scheme == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)
    else:
        amax = w.abs().amax().reshape(1)
    scale = (amax / torch.finfo(FP8).max).clamp(min=1e-12).to(scale_dtype)
    bo, bi = resolve_block(quant.op_block, rows, cols)
    full = expand_block_scale(scale.float().reshape(-(-rows // bo), -1), rows, cols, (bo, bi))
    return (w / full).clamp(-torch.finfo(FP8).max, torch.finfo(FP8).max).to(FP8), scale
