"""W8A16 linear (Triton): `y = x @ (w * scale).T` reading the float8_e4m3fn weight itself.

Decode is memory-bound, so a step should read the FP8 bytes and nothing more: each program
dequantizes its weight tile in registers and multiplies in the activations' dtype with fp32
accumulation. Its K tiles are sized to the scale block where they can be (`quant.dequant.
scale_tiling`), so a tile takes one scale per weight row, or per row and block where a tile covers
whole blocks (`triton_utils.row_scaled`); other blocks gather a scale per element (`scaled_tile`).
The torch reference is the op's dequantize-then-F.linear (`quant/dequant.py`). A few rows take the
skinny GEMM's FP8 path instead (`skinny_kernels`); this kernel serves decode batches above them, up
to W8A16_MAX_M rows (`library.py` routes the calls). Past SHORT_TILE_M rows on Hopper it runs
W8A8 instead (`W8A16Config.a8`): x quantized per token in groups of the weight's block width
(`quant.act_quant`) and fp8 x fp8 dots, each K step scaled by the rows' and columns' scales. Where
the kernel in front has quantized x (`linear.fp8.input_buffers`), 2 to SHORT_TILE_M rows run W8A8
too, the dots swapped (`W8A16Config.swap`): the weight tile is the MMA's wide side, so a few rows
still fill Hopper's 64-row warpgroup MMA, which reads both operands from shared memory.

A program owns a BLOCK_M x BLOCK_N output tile. At decode batches the row tiles are few (one up to
64 rows), so the column blocks alone leave SMs idle (30B's o_proj, N = 2,048: 64 programs of 32
columns on 132 SMs). There SPLIT_K programs share a tile, each over one K range, as the skinny
GEMM splits: fp32 partials to its workspace (shared: one per device, `workspace.py`), a semaphore
per output tile bumped by each split, the last to arrive summing the partials in split order
(deterministic), storing the tile and putting the semaphore back to 0, so the launch needs no
memset or second kernel and replays from a CUDA graph. `w8a16_config` is the only place the tiles
are chosen (bench/linear_bench.py --fp8 sweeps them)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from compiled.linear import skinny_kernels as lk
from compiled.linear.lora_kernels import LoRAArgs
from compiled.quant.dequant import fit_block_k, kernel_scale, resolve_block
from compiled.quant.act_quant import QuantizedRows, quantize_per_token_group
from compiled.triton_utils import (DEFAULT_NUM_SMS, FP8_DOT_MIN_K, fp8_dot_fits, hopper_or_newer,
                                   interpreter_upcast, num_sms, row_scaled, scaled_tile, split_k_store, tile_mask,
                                   w8a8_rows, w8a8_scales, w8a8_step, w8a8_step_t)

MIN_BLOCK = 16       # smallest BLOCK_M / BLOCK_N / BLOCK_K (tl.dot's minimum)
BLOCK_N = 32         # columns a program where the grid fills the GPU without help
MAX_BLOCK_K = 128    # fitted down to divide the scale block (`fit_block_k`)
MAX_BLOCK_M = 64     # up to 64 rows one row tile: the weight is read once
# Up to 32 rows (a row tile of 32): 64 columns and 256-long K steps a program in 3 stages, K split
# only where the grid is short of half the SMs (H200 sweep of the 30B's qkv and o_proj at 32 rows,
# bench/linear_bench.py --fp8; bench/RESULTS.md).
SHORT_TILE_M = 32
SHORT_BLOCK_N = 64
SHORT_BLOCK_K = 256
SHORT_STAGES = 3
# x quantized in front (`linear.fp8.input_buffers`), 2 to SHORT_TILE_M rows on Hopper: W8A8 with the
# dots swapped (weight tile x rows), SWAP_BLOCK_N columns a program and K split until the grid has
# SWAP_PROGRAMS_PER_SM programs an SM. Faster than the skinny GEMM and the short tiles there for the
# 30B's qkv on the H200 (bench/RESULTS.md); one row keeps the skinny GEMM's GEMV, which beat it.
SWAP_BLOCK_N = 64
SWAP_PROGRAMS_PER_SM = 2
MAX_SPLIT_K = 8
MIN_K_STEPS = 4      # K tiles a split at least: shorter, the software pipeline's fill is not hidden
NUM_WARPS = 4
NUM_STAGES = 4


class W8A16Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES
    a8: bool = False   # W8A8: x quantized first (per token, in groups of the scale block's width), fp8 dots
    swap: bool = False  # W8A8 dots as weight tile x rows (`triton_utils.w8a8_step_t`): a few rows on Hopper's wgmma


def swap_rows(M: int, device: torch.device) -> bool:
    """Whether x @ W.T at M rows takes the swapped W8A8 tiles where x arrives quantized."""
    return 1 < M <= SHORT_TILE_M and hopper_or_newer(device)


@functools.lru_cache(maxsize=None)
def w8a16_config(M: int, N: int, K: int, num_sms: int = DEFAULT_NUM_SMS, scale_block_k: int = 0,
                 fp8_dots: bool = False, quantized: bool = False) -> W8A16Config:
    """BLOCK_M: M rounded up to a power of two (16 to MAX_BLOCK_M). Up to SHORT_TILE_M rows the
    SHORT_ tiles (BLOCK_K SHORT_BLOCK_K where it covers whole scale blocks `scale_block_k` wide
    or lies inside one, 0: K, one block across), a grid short of half of `num_sms`; else BLOCK_N
    columns and MAX_BLOCK_K fitted to the scale block, a grid short of `num_sms`. A short grid
    splits K first (powers of two, each split at least MIN_K_STEPS tiles, the partials within
    the workspace), then narrows BLOCK_N towards 16: a narrower column block makes more programs
    re-read the same x tiles (M x K x N / BLOCK_N elements from L2 in all), a split only adds its
    partials (split x M x N fp32). Past SHORT_TILE_M rows W8A8 on a GPU with FP8 tensor cores
    (`fp8_dots`) where the K tiles allow it (`fp8_dot_fits`): x quantized once, its fp8 tiles are half
    the bytes each program re-reads, and the weight tiles go to the tensor cores as loaded (no
    dequantization in registers). With x `quantized` in front, up to SHORT_TILE_M rows on such a
    GPU (`swap_rows`), `swap_config`."""
    block_m = min(MAX_BLOCK_M, max(MIN_BLOCK, triton.next_power_of_2(M)))
    bi = scale_block_k or K
    fitted_k = fit_block_k(bi, MAX_BLOCK_K)
    if quantized and fp8_dots and block_m <= SHORT_TILE_M and fp8_dot_fits(fitted_k, bi):
        return swap_config(M, N, K, num_sms, block_m, fitted_k)
    if block_m <= SHORT_TILE_M:
        block_n, stages, enough = SHORT_BLOCK_N, SHORT_STAGES, max(1, num_sms // 2)
        whole = SHORT_BLOCK_K % bi == 0 or bi % SHORT_BLOCK_K == 0   # one scale a row per block it covers
        block_k = SHORT_BLOCK_K if whole else fitted_k
    else:
        block_n, stages, enough = BLOCK_N, NUM_STAGES, num_sms
        block_k = fitted_k
    row_tiles = triton.cdiv(M, block_m)
    split = 1

    def short(bn: int, s: int) -> bool:
        return triton.cdiv(N, bn) * row_tiles * s < enough

    while short(block_n, split) and can_split(2 * split, M, N, K, block_m, block_n, block_k):
        split *= 2
    while short(block_n, split) and block_n > MIN_BLOCK and fits_workspace(split, M, N, block_m, block_n // 2):
        block_n //= 2
    a8 = fp8_dots and block_m > SHORT_TILE_M and fp8_dot_fits(block_k, bi)
    return W8A16Config(block_m, block_n, block_k, split, NUM_WARPS, stages, a8)


def swap_config(M: int, N: int, K: int, num_sms: int, block_m: int, block_k: int) -> W8A16Config:
    """The swapped W8A8 tiles: SWAP_BLOCK_N columns, K split (`can_split`) until
    SWAP_PROGRAMS_PER_SM programs an SM."""
    split = 1
    while (triton.cdiv(N, SWAP_BLOCK_N) * split < SWAP_PROGRAMS_PER_SM * num_sms
           and can_split(2 * split, M, N, K, block_m, SWAP_BLOCK_N, block_k)):
        split *= 2
    return W8A16Config(block_m, SWAP_BLOCK_N, block_k, split, NUM_WARPS, NUM_STAGES, a8=True, swap=True)


def can_split(split_k: int, M: int, N: int, K: int, block_m: int, block_n: int, block_k: int) -> bool:
    """Whether K splits `split_k` ways: at most MAX_SPLIT_K, each split at least MIN_K_STEPS K
    tiles, the partials within the workspace."""
    return (split_k <= MAX_SPLIT_K and triton.cdiv(K, split_k * block_k) >= MIN_K_STEPS
            and fits_workspace(split_k, M, N, block_m, block_n))


def fits_workspace(split_k: int, M: int, N: int, block_m: int, block_n: int) -> bool:
    """Whether a split of K into `split_k` finds its partials and semaphores in the workspace."""
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    return split_k == 1 or (split_k * M * N <= lk.PARTIALS and tiles <= lk.SEMAPHORES)


def check_config(config: W8A16Config, M: int, N: int) -> None:
    """A forced config the kernel can run, else a one-line ValueError naming the field."""
    if not isinstance(config, W8A16Config):
        raise TypeError(f"w8a16 linear: config must be a W8A16Config, got {type(config).__name__}")
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < MIN_BLOCK or value & (value - 1):
            raise ValueError(f"w8a16 linear: {name}={value!r} must be a power of two >= {MIN_BLOCK}")
    warps = config.num_warps
    if not isinstance(warps, int) or not 1 <= warps <= 16 or warps & (warps - 1):
        raise ValueError(f"w8a16 linear: num_warps={warps!r} must be a power of two from 1 to 16")
    if not isinstance(config.num_stages, int) or config.num_stages < 1:
        raise ValueError(f"w8a16 linear: num_stages={config.num_stages!r} must be an int >= 1")
    if config.swap and not config.a8:
        raise ValueError("w8a16 linear: swap=True needs a8=True (it swaps the W8A8 dot's operands)")
    split = config.split_k
    if not isinstance(split, int) or split < 1 or not fits_workspace(split, M, N, config.block_m, config.block_n):
        raise ValueError(f"w8a16 linear: split_k={split!r} with M={M}, N={N} needs 1 <= split_k, split_k * M * N "
                         f"<= {lk.PARTIALS} and at most {lk.SEMAPHORES} output tiles")


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, sem_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn,
                  stride_sn, stride_ym, BO, BI, xs_ptr, stride_xs, LS, LB, LSCALE, LSLOT, LR, LSLOTS, LO1, LO2, LO3,
                  stride_ls, stride_lbs, stride_lbn, stride_lsc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                  FP8: tl.constexpr, KB: tl.constexpr, A8: tl.constexpr, SWAP: tl.constexpr,
                  ONE_SCALE: tl.constexpr, EVEN_K: tl.constexpr, LORA: tl.constexpr, LORA_N: tl.constexpr,
                  LBLOCK_R: tl.constexpr, LSLOTS_PAD: tl.constexpr, LKC: tl.constexpr, LORA_FP32: tl.constexpr):
    """Partials laid out `[SPLIT_K, M, N]`; output tile (pid_m, pid_n)'s semaphore at
    pid_m * (column blocks) + pid_n. UPCAST: see `interpreter_upcast`. A8 (W8A8): x is
    float8_e4m3fn with fp32 scales `xs_ptr` a row and weight block (BI columns); each K step lies
    inside one block and is an fp8 x fp8 dot scaled by the rows' and columns' scales
    (`triton_utils.w8a8_step`), the scales loaded a step ahead (the loop's pipelining leaves them
    out); ONE_SCALE: the tile's rows inside one block, one weight scale a step; SWAP: into the
    transposed accumulator, the weight tile the MMA's wide side (`w8a8_step_t`). EVEN_K: every K
    tile whole (no K masks). LORA (unsplit only): the tile, rounded to y's dtype, plus its rows'
    LoRA deltas (`skinny_kernels.lora_epilogue`, the expand's arithmetic)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if A8:
        xs_rows = xs_ptr + tl.minimum(offs_m, M - 1) * stride_xs
        w_rows = w8a8_rows(tl.minimum(offs_n, N - 1), pid_n, BLOCK_N, ONE_SCALE)
        sa_n, sw_n = w8a8_scales(xs_rows, s_ptr, w_rows, k_start, stride_sn, BO, BI)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        w_mask = tile_mask(offs_n < N, mask_k, EVEN_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=tile_mask(offs_m < M, mask_k, EVEN_K),
                    other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=w_mask, other=0.0)
        if A8:
            sa, sw = sa_n, sw_n
            sa_n, sw_n = w8a8_scales(xs_rows, s_ptr, w_rows, tl.minimum(k0 + BLOCK_K, K - 1), stride_sn, BO, BI)
            if SWAP:
                acc_t = w8a8_step_t(acc_t, x, tl.trans(w), sa, sw, "tf32", ONE_SCALE)
            else:
                acc = w8a8_step(acc, x, tl.trans(w), sa, sw, "tf32", ONE_SCALE)
        else:
            if FP8 == 2:
                b = row_scaled(w, s_ptr, offs_n, offs_n < N, k0, K, stride_sn, BO, BI, x.dtype, KB)
            else:
                b = scaled_tile(w, s_ptr, offs_n[:, None], offs_k[None, :], w_mask, stride_sn, BO, BI, x.dtype, True)
            if UPCAST:
                x = x.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc += tl.dot(x, tl.trans(b), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(b))
    if SWAP:
        acc += tl.trans(acc_t)
    if LORA:
        acc = lk.lora_epilogue(acc.to(y_ptr.dtype.element_ty).to(tl.float32), offs_m, offs_m < M, offs_n,
                               offs_n < N, pid_n * BLOCK_N, N, LS, LB, LSCALE, LSLOT, LR, LSLOTS, LO1, LO2, LO3,
                               stride_ls, stride_lbs, stride_lbn, stride_lsc, LORA_N, BLOCK_N, LBLOCK_R, LSLOTS_PAD,
                               LKC, LORA_FP32, False)
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    split_k_store(acc, y_ptrs, part_ptr + offs_m[:, None] * N + offs_n[None, :], M * N, y_mask,
                  sem_ptr + pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT_K)


def default_config(x: torch.Tensor, weight: torch.Tensor, block: list[int], quantized: bool = False) -> W8A16Config:
    """`w8a16_config` for x @ weight.T on x's device (`quantized`: x quantized in front)."""
    (M, K), N = x.shape, weight.shape[0]
    return w8a16_config(M, N, K, num_sms(x.device), resolve_block(block, N, K)[1], hopper_or_newer(x.device),
                        quantized)


def lora_in_epilogue(x: torch.Tensor, weight: torch.Tensor, block: list[int], quantized: bool = False) -> bool:
    """Whether x @ weight.T can add LoRA deltas in its epilogue: its config runs one K split."""
    return default_config(x, weight, block, quantized).split_k == 1


def a8_group(x: torch.Tensor, weight: torch.Tensor, block: list[int], quantized: bool = False) -> int:
    """The group width x is quantized in first where the kernel runs x @ weight.T W8A8 (the scale
    block's width), else 0."""
    N, K = weight.shape
    return resolve_block(block, N, K)[1] if default_config(x, weight, block, quantized).a8 else 0


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: list[int],
                 config: W8A16Config | None = None, quantized: QuantizedRows | None = None,
                 lora: LoRAArgs | None = None) -> torch.Tensor:
    """x `[M, K]` (rows contiguous) @ (weight `[N, K]` fp8 x its block `scale`).T -> `[M, N]` in
    x's dtype. `config` overrides `w8a16_config` (tests, the benchmark's sweep). `quantized`: x
    already quantized there (`a8_group` wide) by the kernel before, for a W8A8 config. `lora`:
    plus the rows' LoRA deltas in the epilogue, rounded as `lora.expand` rounds them (configs of
    one K split only: `lora_in_epilogue`)."""
    M, K = x.shape
    N = weight.shape[0]
    if config is None:
        config = default_config(x, weight, block, quantized is not None)
    else:
        check_config(config, M, N)
    block_m, block_n, block_k, split_k, num_warps, num_stages, a8, swap = config
    if lora is not None and split_k != 1:
        raise ValueError(f"w8a16 linear: LoRA deltas in the epilogue need one K split, the config has {split_k}")
    ks = kernel_scale(scale, block, N, K, block_k)
    if a8 and not fp8_dot_fits(block_k, ks.bi):
        raise ValueError(f"w8a16 linear: a8 needs block_k={block_k} >= {FP8_DOT_MIN_K} dividing the weight's "
                         f"scale block width {ks.bi}")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws = lk.split_workspace(x.device) if split_k > 1 else None
    partials, semaphores = (ws.partials, ws.semaphores) if ws is not None else (y, y)  # never read unsplit
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    upcast = interpreter_upcast(x.dtype)
    xs = y   # never read without A8
    if quantized is not None:
        if not a8:
            raise ValueError(f"w8a16 linear: x quantized for a W8A8 kernel, but the config {tuple(config)} is W8A16 "
                             f"(a8=False)")
        if quantized.group != ks.bi:
            raise ValueError(f"w8a16 linear: x quantized in groups of {quantized.group}, the weight's blocks are "
                             f"{ks.bi} wide")
        x, xs = quantized.q, quantized.s
    elif a8:
        x, xs = quantize_per_token_group(x, ks.bi)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m), split_k)
    _w8a16_kernel[grid](x, weight, ks.scale, y, partials, semaphores, M, N, K, k_per_split, x.stride(0),
                        weight.stride(0), ks.scale.stride(0), y.stride(0), ks.bo, ks.bi, xs, xs.stride(0),
                        **lk.lora_args(y, lora), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                        IEEE=upcast or x.dtype == torch.float32, UPCAST=upcast, FP8=ks.mode, KB=ks.kb, A8=a8,
                        SWAP=swap, ONE_SCALE=a8 and ks.bo % block_n == 0, EVEN_K=K % block_k == 0,
                        num_warps=num_warps, num_stages=num_stages)
    return y
