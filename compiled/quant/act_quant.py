"""Activations quantized to float8_e4m3fn per token in groups of K (the W8A8 grouped GEMMs' A
operand): each row's columns in groups of `group` (the weight's scale block width, so that a K
tile lies inside one group), each group with an fp32 scale max|x_group| / 448.

Values are rounded to the e4m3 grid in fp32 arithmetic (to nearest, ties to even, as torch's cast
rounds) before the cast, so the cast itself is exact: Triton's CPU interpreter casts to float8
without carrying a rounded-up mantissa into the exponent, and the GPU gives the same result
either way. An all-zero group takes the scale ACT_EPS / 448 and quantizes to zeros."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from compiled.triton_utils import launch_kwargs, pdl_wait

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
ACT_EPS = 1e-10   # the smallest group maximum: a zero group gets a finite, nonzero scale
_EPS, _FMAX = tl.constexpr(ACT_EPS), tl.constexpr(FP8_MAX)   # the same, inside the kernels
# A program takes a tile of up to MAX_ROWS rows by as many whole groups as make PROGRAM_ELEMENTS
# (padded) elements: two groups of 128, so that 768-wide rows (the MoE intermediate's six groups)
# do not pad to eight as whole-row tiles did; a short batch takes fewer rows a program, down to
# one, so that it still spreads over about ROW_PROGRAMS programs a group block. A batch long enough
# for MAX_ROWS rows a program takes one group a program: twice the programs (H200 A/B and sweep in
# bench/RESULTS.md, FP8 weights).
PROGRAM_ELEMENTS = 4096
MAX_ROWS = 16
ROW_PROGRAMS = 16


class QuantizedRows(NamedTuple):
    """Where rows quantized per token in `group`-wide groups go: `q` `[rows, K]` float8_e4m3fn
    (unit last stride; rows past the tokens, a padded buffer's, are left alone) and `s`
    `[rows, ceil(K / group)]` fp32, any strides. A kernel before the one that reads them fills them."""
    q: torch.Tensor
    s: torch.Tensor
    group: int


def row_quantizable(K: int, group: int) -> bool:
    """Whether `quantize_row` takes rows of K in `group`-wide groups: a power of two up to K's."""
    return 0 < group <= triton.next_power_of_2(K) and group & (group - 1) == 0


def quantize_per_token_group_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq `[T, K]` float8_e4m3fn, xs `[T, ceil(K/group)]` fp32) with x ~ xq * xs repeated over
    each group (the last group may be partial)."""
    T, K = x.shape
    G = -(-K // group)
    padded = torch.zeros(T, G * group, dtype=torch.float32, device=x.device)
    padded[:, :K] = x.float()
    amax = padded.view(T, G, group).abs().amax(dim=2).clamp(min=ACT_EPS)
    xs = amax / FP8_MAX
    y = (padded.view(T, G, group) / xs[:, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return y.reshape(T, G * group)[:, :K].to(FP8), xs


def dequantize_per_token_group(xq: torch.Tensor, xs: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """xq times its group scales, in `dtype` (the oracle of the W8A8 GEMMs' activations)."""
    K = xq.shape[1]
    return (xq.double() * xs.double().repeat_interleave(group, dim=1)[:, :K]).to(dtype)


@triton.jit
def _round_e4m3(y):
    """y (fp32, |y| <= 448) rounded to the nearest float8_e4m3fn value, ties to even: adding and
    subtracting 1.5 * 2^23 ulps, where ulp is the e4m3 spacing at y (2^-9 below 2^-6)."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = ulp * 12582912.0   # 1.5 * 2^23: the sum stays in one binade whose fp32 spacing is ulp
    return (y + magic) - magic


@triton.jit
def quantized_groups(x, AXIS: tl.constexpr):
    """x (fp32) quantized as `quantize_per_token_group_ref` does, one group along AXIS (masked
    elements 0): (its values rounded to the e4m3 grid, still fp32; the groups' scales). The
    standalone kernel below and the MoE up GEMM's epilogue that quantizes the intermediate for a
    W8A8 down GEMM (`moe.fused_moe_kernels`) share it, so both give the same bits."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=AXIS), _EPS)
    scale = amax / _FMAX
    y = tl.minimum(tl.maximum(x / tl.expand_dims(scale, AXIS), -_FMAX), _FMAX)
    return _round_e4m3(y), scale


@triton.jit
def quantize_row(v, mask, Q, S, stride_sg, K, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """One row's values `v` (fp32 `[BLOCK]`, lanes past K masked to 0) quantized as
    `quantize_per_token_group_ref` does, GROUP (a power of two dividing BLOCK) wide: the values
    to Q (the row's start), each group's scale to S with stride `stride_sg`. A kernel that holds
    the row (the norm in front of a W8A8 linear) saves the quantization's launch and read."""
    G: tl.constexpr = BLOCK // GROUP
    y, scale = quantized_groups(tl.reshape(v, (G, GROUP)), 1)
    tl.store(Q + tl.arange(0, BLOCK), tl.reshape(y, (BLOCK,)).to(Q.dtype.element_ty), mask=mask)
    g = tl.arange(0, G)
    tl.store(S + g * stride_sg, scale, mask=g * GROUP < K)


@triton.jit
def quantize_tile(x_ptr, q_ptr, s_ptr, first, end, g0, K, stride_x, stride_q, stride_s, stride_sg, GROUP,
                  ROWS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr):
    """Rows `first` on (those before `end`), groups `g0` on, as a `[ROWS, GROUPS, BLOCK_G]` tile:
    each group's max, scale and rounded values. The standalone kernel below and the MoE's
    alignment launch, whose spare programs quantize x for the W8A8 up GEMM, share it."""
    rows = (first + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < end
    g = g0 + tl.arange(0, GROUPS)
    c = tl.arange(0, BLOCK_G)
    cols = (g[:, None] * GROUP + c[None, :])[None, :, :]
    ok = row_ok[:, None, None] & ((c < GROUP)[None, None, :] & (cols < K))
    r3 = rows[:, None, None]
    x = tl.load(x_ptr + r3 * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    y, scale = quantized_groups(x, 2)
    tl.store(q_ptr + r3 * stride_q + cols, y.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + rows[:, None] * stride_s + g[None, :] * stride_sg, scale,
             mask=row_ok[:, None] & (g * GROUP < K)[None, :])


@triton.jit
def _quant_group_kernel(x_ptr, q_ptr, s_ptr, rows_ptr, T, K, stride_x, stride_q, stride_s, stride_sg, GROUP,
                        ROWS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
                        LIVE_ROWS: tl.constexpr, PDL: tl.constexpr):
    """Program (i, j): rows i * ROWS on, groups j * GROUPS on (`quantize_tile`). LIVE_ROWS: rows
    from `rows_ptr[0]` on are left as they are."""
    pdl_wait(PDL)
    first = tl.program_id(0) * ROWS
    end = T
    if LIVE_ROWS:
        end = tl.minimum(tl.load(rows_ptr), T)
        if first >= end:
            return
    quantize_tile(x_ptr, q_ptr, s_ptr, first, end, tl.program_id(1) * GROUPS, K, stride_x, stride_q, stride_s,
                  stride_sg, GROUP, ROWS, GROUPS, BLOCK_G)


def quant_tile(T: int, G: int, block_g: int) -> tuple[int, int]:
    """(rows, groups) a program of `_quant_group_kernel` for T rows of G groups `block_g` wide
    (padded): rows T / ROW_PROGRAMS (a power of two, at least one) up to MAX_ROWS; groups as many
    as fill PROGRAM_ELEMENTS at MAX_ROWS rows, or one where the rows reach MAX_ROWS."""
    rows = triton.next_power_of_2(triton.cdiv(T, ROW_PROGRAMS))
    if rows >= MAX_ROWS:
        return MAX_ROWS, 1
    groups = max(1, min(triton.next_power_of_2(G), PROGRAM_ELEMENTS // (MAX_ROWS * block_g)))
    rows = max(1, min(rows, PROGRAM_ELEMENTS // (groups * block_g)))   # rows < MAX_ROWS here
    return rows, groups


class QuantGrid(NamedTuple):
    """A quantization launch over T rows of K in `group`-wide groups: `quant_tile`'s `rows` x
    `groups` a program, each group `block_g` (padded) wide, in `row_programs` x `group_programs`
    programs. The standalone kernel and the MoE's alignment launch both take theirs from here."""
    rows: int
    groups: int
    block_g: int
    row_programs: int
    group_programs: int


def quant_grid(T: int, K: int, group: int) -> QuantGrid:
    """`QuantGrid` of T rows of K in `group`-wide groups."""
    G = triton.cdiv(K, group)
    block_g = triton.next_power_of_2(group)
    rows, groups = quant_tile(T, G, block_g)
    return QuantGrid(rows, groups, block_g, triton.cdiv(T, rows), triton.cdiv(G, groups))


def quantize_per_token_group(x: torch.Tensor, group: int, out: torch.Tensor | None = None,
                             scale_out: torch.Tensor | None = None, live_rows: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_token_group_ref` in one Triton launch; x `[T, K]` with unit last stride.
    `out` `[T, K]` float8_e4m3fn (contiguous) and `scale_out` `[T, ceil(K/group)]` fp32 (any
    strides: cuBLAS takes the scales column-major): where to write (a workspace's), else new
    tensors. `live_rows` (int32 `[1]` on x's device): only
    the rows before it are written (a buffer sized for the worst case, its count known on the
    device only, as the MoE's padded pair count)."""
    T, K = x.shape
    G = triton.cdiv(K, group)
    if x.stride(1) != 1:
        raise ValueError(f"quantize_per_token_group: x needs unit last stride, got strides {list(x.stride())}")
    q = torch.empty(T, K, dtype=FP8, device=x.device) if out is None else out
    s = torch.empty(T, G, dtype=torch.float32, device=x.device) if scale_out is None else scale_out
    if T:
        qg = quant_grid(T, K, group)
        _quant_group_kernel[(qg.row_programs, qg.group_programs)](
            x, q, s, x if live_rows is None else live_rows, T, K, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
            group, ROWS=qg.rows, GROUPS=qg.groups, BLOCK_G=qg.block_g, LIVE_ROWS=live_rows is not None,
            num_warps=4, **launch_kwargs(x.device))
    return q, s
