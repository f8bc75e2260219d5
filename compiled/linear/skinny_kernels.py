"""Skinny GEMM (Triton): `y = x @ w.T` for a few rows of x (decode), one launch, weight streamed once.

At M <= 16 rows a linear reads its whole weight to do almost no arithmetic, so its time is the
weight's bytes over the memory bandwidth, plus the launch. cuBLAS picks tiles made for large M:
too few programs to keep every SM's loads in flight, and split-K as a second (reduce) kernel.

For one row the kernel runs in its GEMV mode (no tensor-core tile: see `_skinny_kernel`; the
mode serves several rows too, for a forced config and the benchmark's sweep).
Otherwise each program owns BLOCK_N output columns for all M rows (one tile of 16 rows, masked, so
`tl.dot` runs on the tensor cores with fp32 accumulation; a narrow weight's up to 64 in more row
tiles of 16, `max_rows`) and walks its K range in BLOCK_K steps, the weight tiles `[BLOCK_N,
BLOCK_K]` contiguous along K (coalesced) and software-pipelined (num_stages). When N / BLOCK_N
programs cannot fill the GPU (router N=128, o_proj N=2048), SPLIT_K programs share a column block,
each over one K range: they write fp32 partials to a workspace and bump that output tile's
semaphore; the last to arrive sums the partials in split order (deterministic), writes the output
and puts the semaphore back to 0. So there is no second launch and no memset, and the launch is safe
to capture in a CUDA graph: the workspace and semaphores are allocated once per device, before
capture, and the kernel leaves them as it found them.

`skinny_config` (the heuristic) and the constants below are the only tuning knobs. The torch
reference is `compiled.linear.ops.linear_ref` (F.linear), beside the op that dispatches here."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from compiled.linear import SKINNY_MAX_M, max_rows, workspace
from compiled.linear.lora_kernels import LoRAArgs, add_slice_deltas, fma_delta_apply, fma_delta_operands, token_slots
from compiled.quant.dequant import WeightScale, kernel_scale
from compiled.triton_utils import (DEFAULT_NUM_SMS, chunk_scaled_dots, fp8_convert_asm, fp8_f32, gemv_chunk,
                                   interpreter_upcast, launch_kwargs, num_sms, pdl_let_next_in, pdl_wait, pdl_wait_only,
                                   preload_fits, preload_tiles, preloaded_dots, residual_add, rms_normed, row_scaled,
                                   scaled_tile, silu_mul, tile_mask, weight_tile, weighted_rows)

BLOCK_M = max(16, triton.next_power_of_2(SKINNY_MAX_M))  # one tile for every row (tl.dot needs >= 16)
MIN_BLOCK = 16             # smallest BLOCK_N / BLOCK_K (tl.dot's minimum)
MAX_BLOCK_N = 64
MAX_BLOCK_K = 128
MAX_SPLIT_K = 16
MIN_K_PER_SPLIT = 128      # one BLOCK_K tile: a shorter split cannot amortise its partials and semaphore
WIDE_PROGRAMS_PER_SM = 2   # this many 64-column blocks per SM fill the GPU without splitting K
SPLIT_COLUMNS_PER_SM = 64  # split-K: columns x splits in flight per SM (H200 sweep, bench/RESULTS.md)
WORKSPACE_COLS = 128 * 1024  # split-K needs SPLIT_K * N <= this (fp32 partials: 16 x this x 4 B = 8 MiB)
SEMAPHORES = WORKSPACE_COLS // MIN_BLOCK  # split-K: one per output tile (column block x row tile)
SUMS = (SEMAPHORES + MAX_SPLIT_K) * BLOCK_M  # split-K with a norm prologue: a tile's rows' sums of squares a split
PARTIALS = SKINNY_MAX_M * WORKSPACE_COLS  # fp32 partials the workspace holds (the W8A16 GEMM splits K in it too)
NUM_WARPS = 4
NUM_STAGES = 5
# With a prologue (`fused`), at most this many K steps a program: its input tiles are
# prefetched one step ahead only, so a long K range leaves part of each step's load latency
# exposed and more, shorter programs hide it better (bench/linear_bench.py --fused, RESULTS.md).
PROLOGUE_MAX_STEPS = 4
# One row (M = 1) takes the GEMV mode: 2 columns a program (1 where 2 would leave half the SMs
# idle: the router), 1024-wide K steps, 4 warps, K split only where even that grid is short. The
# best of sweeps on every decode linear of both models, where it beat the tensor-core tiles and
# cuBLAS (H100, bench/gemv_bench.py; bench/RESULTS.md). Wide N (the LM head) keeps
# the tiles.
GEMV_BLOCK_N = 2
GEMV_MAX_BLOCK_K = 1024
# A GEMV of one column a program and no split (the router) takes K steps up to this: the 30B's
# router row is one step, which the kernel loads before its PDL wait (H200, bench/RESULTS.md).
NARROW_GEMV_MAX_BLOCK_K = 2048
GEMV_NUM_WARPS = 4
GEMV_MAX_M = 1             # rows the heuristic gives the mode (it serves up to SKINNY_MAX_M: a forced config)
# The GEMV tiles of an FP8 weight (one byte an element: a tile of the same shape is half the
# bytes a load): twice the columns; where N gives at least FP8_GEMV_WIDE_PROGRAMS_PER_SM programs
# an SM of FP8_GEMV_WIDE_N columns, those, half as long in K, on 2 warps (the 30B's qkv; o_proj
# keeps the first). The best of H200 sweeps (bench/linear_bench.py --fp8; bench/RESULTS.md).
FP8_GEMV_BLOCK_N = 2 * GEMV_BLOCK_N
FP8_GEMV_MAX_BLOCK_K = GEMV_MAX_BLOCK_K
FP8_GEMV_WIDE_N = 8
FP8_GEMV_WIDE_BLOCK_K = 512
FP8_GEMV_WIDE_WARPS = 2
FP8_GEMV_WIDE_PROGRAMS_PER_SM = 4
# A narrow weight's rows past one tile (the router at 17-64 rows): 16-row tiles, K steps this long,
# 16 columns a program after its add + RMSNorm, 32 without, K split until the grid holds about one
# program an SM: fewer, longer splits than the one-tile rule's (H200 sweep of the 30B's router at
# 32-64 rows, with and without its norm; bench/RESULTS.md).
NARROW_BLOCK_K = 256


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES
    gemv: bool = False     # FMA into registers instead of a tensor-core tile (one row, by the heuristic)


@functools.lru_cache(maxsize=None)
def skinny_config(M: int, N: int, K: int, num_sms: int = DEFAULT_NUM_SMS, prologue_steps: int = 0,
                  weight_bytes: int = 2) -> SkinnyConfig:
    """From a sweep on the H200 (bench/linear_bench.py --sweep; RESULTS.md). A wide N (the LM
    head) takes 64-column blocks and no split. Otherwise 64 columns from N = 2048 down to 32 (16
    for N <= 128), and SPLIT_K the largest power of two that keeps N x SPLIT_K within
    SPLIT_COLUMNS_PER_SM x num_sms, each split at least MIN_K_PER_SPLIT long and the partials
    within the workspace. Up to GEMV_MAX_M rows take the GEMV mode instead (`gemv_config`), past
    SKINNY_MAX_M (a narrow weight's rows) `narrow_config`; otherwise M does not enter: at M <= 16
    the time is the weight's bytes. `prologue_steps` (a kernel with a prologue:
    PROLOGUE_MAX_STEPS): split further, within the same bounds, until a program has at most that
    many K steps. `weight_bytes`: the weight's element size (1: FP8),
    which picks the GEMV tiles; an FP8 weight's tiles are twice as long in K and its splits take
    twice the columns per SM: the same bytes in flight (H200 sweep, bench/linear_bench.py --fp8)."""
    per_byte = 2 if weight_bytes == 1 else 1
    block_k = min(MAX_BLOCK_K * per_byte, max(MIN_BLOCK, triton.next_power_of_2(K)))
    if triton.cdiv(N, MAX_BLOCK_N) >= WIDE_PROGRAMS_PER_SM * num_sms:
        return SkinnyConfig(MAX_BLOCK_N, block_k, 1)
    if M <= GEMV_MAX_M:
        return gemv_config(N, K, num_sms, weight_bytes)
    if M > SKINNY_MAX_M:
        return narrow_config(M, N, K, num_sms, prologue_steps > 0)
    block_n = MAX_BLOCK_N if N >= 2048 else (2 * MIN_BLOCK if N > 128 else MIN_BLOCK)
    max_split = min(MAX_SPLIT_K, K // MIN_K_PER_SPLIT, PARTIALS // (max(M, SKINNY_MAX_M) * max(N, 1)))
    split = 1
    while 2 * split <= max_split and N * 2 * split <= SPLIT_COLUMNS_PER_SM * per_byte * num_sms:
        split *= 2
    while prologue_steps and 2 * split <= max_split and triton.cdiv(K, split * block_k) > prologue_steps:
        split *= 2
    return SkinnyConfig(block_n, block_k, split)


def narrow_config(M: int, N: int, K: int, num_sms: int, prologue: bool) -> SkinnyConfig:
    """A narrow weight (`max_rows`) at more rows than one tile: MIN_BLOCK columns a program with a
    `prologue`, twice that without, NARROW_BLOCK_K-long K steps, K split (powers of two, each split
    at least one step) while the grid stays within one program an SM."""
    block_n = MIN_BLOCK if prologue else 2 * MIN_BLOCK
    block_k = min(NARROW_BLOCK_K, max(MIN_BLOCK, triton.next_power_of_2(K)))
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, BLOCK_M)
    split = 1
    while 2 * split <= MAX_SPLIT_K and tiles * 2 * split <= num_sms and K // (2 * split) >= block_k:
        split *= 2
    return SkinnyConfig(block_n, block_k, split)


def gemv_config(N: int, K: int, num_sms: int, weight_bytes: int = 2) -> SkinnyConfig:
    """GEMV_BLOCK_N columns a program, or one where that grid is short of half the SMs; a grid
    still short splits K (a power of two, up to one program per SM, each split at least
    MIN_K_PER_SPLIT long); K steps up to GEMV_MAX_BLOCK_K (NARROW_GEMV_MAX_BLOCK_K for one column
    a program unsplit). An FP8 weight (`weight_bytes` 1) takes the FP8_GEMV_ constants instead,
    the wide tiles where N fills the SMs with them."""
    if weight_bytes == 1 and triton.cdiv(N, FP8_GEMV_WIDE_N) >= FP8_GEMV_WIDE_PROGRAMS_PER_SM * num_sms:
        block_k = min(FP8_GEMV_WIDE_BLOCK_K, max(MIN_BLOCK, triton.next_power_of_2(K)))
        return SkinnyConfig(FP8_GEMV_WIDE_N, block_k, 1, FP8_GEMV_WIDE_WARPS, num_stages=1, gemv=True)
    widest_n, max_block_k = ((FP8_GEMV_BLOCK_N, FP8_GEMV_MAX_BLOCK_K) if weight_bytes == 1
                             else (GEMV_BLOCK_N, GEMV_MAX_BLOCK_K))
    block_n = widest_n if triton.cdiv(N, widest_n) >= num_sms // 2 else 1
    blocks = triton.cdiv(N, block_n)
    split = 1
    if blocks < num_sms // 2:
        while 2 * split <= MAX_SPLIT_K and K // (2 * split) >= MIN_K_PER_SPLIT and blocks * 2 * split <= num_sms:
            split *= 2
    if block_n == 1 and split == 1:   # the router: its row in one step, loaded before the PDL wait
        max_block_k = max(max_block_k, NARROW_GEMV_MAX_BLOCK_K)
    block_k = min(max_block_k, max(MIN_BLOCK, triton.next_power_of_2(triton.cdiv(K, split))))
    return SkinnyConfig(block_n, block_k, split, GEMV_NUM_WARPS, num_stages=1, gemv=True)


def preload_steps(config: SkinnyConfig, M: int, K: int, chunk: int, prologue: bool) -> int:
    """The kernel's PRELOAD: a one-row FP8 GEMV's K steps (`chunk` > 1, a byte an element) without
    a prologue or a K split, loaded before the PDL wait where they fit (`preload_fits`: the 30B's
    qkv and o_proj at one row); else 0 (the K loop)."""
    one_row = config.gemv and M == 1 and config.split_k == 1 and chunk > 1 and not prologue
    return preload_fits(config.block_n, config.block_k, K, config.num_warps) if one_row else 0


def beats_cublas(config: SkinnyConfig, N: int, num_sms: int = DEFAULT_NUM_SMS) -> bool:
    """Where the kernel is worth a launch over cuBLAS: in the GEMV mode (one row: every decode
    linear measured), when it splits K (cuBLAS at M <= 16 either leaves SMs idle or adds a reduce
    kernel: router, o_proj, down) or N is wide (the LM head, 4%). A mid-size N in one pass of
    tensor-core tiles (qkv, gate/up at 2-16 rows) is what cuBLAS does as well or better, in the
    decode step too (the 30B's qkv and the 0.6B's gate/up; bench/RESULTS.md)."""
    return config.gemv or config.split_k > 1 or triton.cdiv(N, MAX_BLOCK_N) >= WIDE_PROGRAMS_PER_SM * num_sms


def check_config(config: SkinnyConfig, M: int, N: int) -> None:
    smallest = 1 if config.gemv else MIN_BLOCK  # tl.dot's minimum does not bind the GEMV mode
    for name in ("block_n", "block_k"):
        value = getattr(config, name)
        if value < smallest or value & (value - 1):
            raise ValueError(f"skinny linear: {name}={value} must be a power of two >= {smallest}")
    block_m = row_tile(M, config.gemv)
    tiles = triton.cdiv(N, config.block_n) * triton.cdiv(M, block_m)
    sums = tiles * config.split_k * max(block_m, BLOCK_M)   # a forced GEMV mode's row tile may pass BLOCK_M
    if config.split_k < 1 or config.split_k > 1 and (config.split_k * N > WORKSPACE_COLS
                                                     or config.split_k * M * N > PARTIALS or tiles > SEMAPHORES
                                                     or sums > SUMS):
        raise ValueError(f"skinny linear: split_k={config.split_k} with M={M}, N={N} needs 1 <= split_k, "
                         f"split_k * N <= {WORKSPACE_COLS}, split_k * M * N <= {PARTIALS} and at most "
                         f"{SEMAPHORES} output tiles")
    if M > max_rows(N):
        raise ValueError(f"skinny linear: M={M} rows, at most {max_rows(N)} for a weight of {N} rows")


def row_tile(M: int, gemv: bool) -> int:
    """BLOCK_M: the GEMV mode's M rounded up to a power of two; the tensor-core tiles' 16 rows,
    more rows taking more row tiles."""
    return triton.next_power_of_2(M) if gemv else BLOCK_M


class SplitWorkspace(NamedTuple):
    partials: torch.Tensor   # fp32 [PARTIALS]
    semaphores: torch.Tensor  # int32, one per output tile, all zero between launches
    sums: torch.Tensor       # fp32, the norm prologue's sums of squares, BLOCK_M per (output tile, split)


# its name in the workspace registry (`workspace.py`), which the W8A16 GEMM's splits share
SKINNY_KERNEL = "skinny linear / W8A16 GEMM"


def _allocate_workspace(device: torch.device) -> SplitWorkspace:
    return SplitWorkspace(
        torch.empty(PARTIALS, dtype=torch.float32, device=device),
        torch.zeros(SEMAPHORES, dtype=torch.int32, device=device),
        torch.empty(SUMS, dtype=torch.float32, device=device))


def split_workspace(device: torch.device) -> SplitWorkspace:
    """One per device, at its largest size, so it is never reallocated; the first split-K call
    must come before any CUDA graph capture (`workspace.py` says why). The W8A16 GEMM
    (`fp8_kernels`) splits K in it too: launches on one stream, each leaving the semaphores at 0."""
    return workspace.split_workspace(SKINNY_KERNEL, device, _allocate_workspace)


@triton.jit
def _prologue_tiles(X, D, offs_m, ks, mask, stride_xm, stride_dm, K, ADD_NORM: tl.constexpr):
    """A prologue's two input tiles for columns ks: (x, delta) for ADD_NORM; (gate, up) of a
    `[M, 2K]` gate/up row for SILU_MUL."""
    a = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0)
    if ADD_NORM:
        b = tl.load(D + offs_m[:, None] * stride_dm + ks[None, :], mask=mask, other=0.0)
    else:
        b = tl.load(X + offs_m[:, None] * stride_xm + (K + ks)[None, :], mask=mask, other=0.0)
    return a, b


@triton.jit
def _store_normed(X, D, NW, NORMED, offs_m, mask_m, rstd, pid_n, NORMED_CHUNK, K, stride_xm, stride_dm,
                  stride_nm, BLOCK_K: tl.constexpr):
    """Column block pid_n writes its slice of the normalised rows (RMSNorm's output, for the
    other readers of it), rounded as `functional.rms_norm` rounds."""
    offs_k = tl.arange(0, BLOCK_K)
    lo = pid_n * NORMED_CHUNK
    hi = tl.minimum(lo + NORMED_CHUNK, K)
    for k0 in range(lo, hi, BLOCK_K):
        ks = k0 + offs_k
        mask = mask_m[:, None] & (ks < hi)[None, :]
        x, d = _prologue_tiles(X, D, offs_m, ks, mask, stride_xm, stride_dm, K, True)
        h = residual_add(x, d)
        nw = tl.load(NW + ks, mask=ks < hi, other=0.0)
        normed = rms_normed(h, rstd[:, None], nw[None, :])
        tl.store(NORMED + offs_m[:, None] * stride_nm + ks[None, :], normed.to(h.dtype), mask=mask)


@triton.jit
def lora_epilogue(acc, offs_m, mask_m, offs_n, mask_n, block_lo, N, LS, LB, LSCALE, LSLOT, LR, LSLOTS, LO1, LO2, LO3,
                  stride_ls, stride_lbs, stride_lbn, stride_lsc, LORA_N: tl.constexpr, BLOCK_N: tl.constexpr,
                  LBLOCK_R: tl.constexpr, LSLOTS_PAD: tl.constexpr, LKC: tl.constexpr, LORA_FP32: tl.constexpr,
                  GEMV: tl.constexpr):
    slots = token_slots(LSLOT, offs_m, mask_m, LSLOTS)
    return add_slice_deltas(acc, LS, LB, LSCALE, slots, offs_m.to(tl.int64), offs_n, mask_n, block_lo, LR, LO1, LO2,
                            LO3, N, stride_ls, stride_lbs, stride_lbn, stride_lsc, LORA_N, BLOCK_N, LBLOCK_R,
                            LSLOTS_PAD, LKC, LORA_FP32, GEMV)


@triton.jit
def _gemv_tile(w_ptrs, mask_n, mask_k, EVEN_K: tl.constexpr, FP8_ASM: tl.constexpr):
    """The GEMV mode's weight tile, FP8_ASM: converted to fp32 as loaded."""
    w = weight_tile(w_ptrs, mask_n, mask_k, EVEN_K)
    if FP8_ASM:
        w = fp8_f32(w, True)
    return w


@triton.jit
def _skinny_kernel(
    X, W, Y, Partials, Semaphores, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_ym,
    D, NW, H, NORMED, Sums, eps, NORMED_CHUNK, stride_dm, stride_hm, stride_nm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ADD_NORM: tl.constexpr, SILU_MUL: tl.constexpr, KEEP_NORMED: tl.constexpr, GEMV: tl.constexpr,
    PDL: tl.constexpr,
    LS, LB, LSCALE, LSLOT, LR, LSLOTS, LO1, LO2, LO3, stride_ls, stride_lbs, stride_lbn, stride_lsc,
    LORA: tl.constexpr, LORA_N: tl.constexpr, LBLOCK_R: tl.constexpr, LSLOTS_PAD: tl.constexpr, LKC: tl.constexpr,
    LORA_FP32: tl.constexpr, WS, stride_wsn, BO, BI, FP8: tl.constexpr, KB: tl.constexpr, FP8_ASM: tl.constexpr,
    CHUNK: tl.constexpr, PRELOAD: tl.constexpr,
):
    """EVEN_K (K a multiple of BLOCK_K, so every split is whole tiles): no mask along K, which
    keeps the weight loads vectorised. Y may be wider than X (fp32 logits): the output is rounded
    to X's dtype first, as the linear's own output would be.

    Prologues, what the kernel does to x before the dot. ADD_NORM: x and D are the residual
    stream and the output added to it; the dot reads (x + D) * norm_weight and, RMSNorm's 1 / rms
    being one factor a row, the finished row is scaled by it (sums of squares gathered on the way,
    across splits like the partials). Column block 0 stores the sum H, and with KEEP_NORMED each
    column block's finishing program a slice of the normalised rows. SILU_MUL: x is a fused
    `[M, 2K]` gate/up output and the dot reads silu(gate) * up.

    LORA, an epilogue: the finished tile, rounded to X's dtype as the linear's output, gets each
    row's multi-LoRA delta as `lora_expand` adds it (`lora_kernels.add_slice_deltas`; LS the rows'
    shrink output, LB `[S, N, R]`, LSCALE `[S, slices]`, LSLOT the rows' slots, LO1..3 where the
    slices start), so that a decode linear's delta costs no launch of its own. In the GEMV mode
    (unsplit) its operands are loaded right after the wait, beside the weights, and added after
    the loop (`fma_delta_operands`, `fma_delta_apply`).

    GEMV (BLOCK_M = M rounded up to a power of two, 1 by the heuristic): no tensor-core tile. The
    weight tile goes straight into registers and is multiplied by each row into an fp32
    `[BLOCK_N, BLOCK_K]` accumulator (`[BLOCK_M, BLOCK_N, BLOCK_K]` for several rows), reduced
    along K once after the loop; everything else (prologues, splits, the epilogue) is the same
    code.

    FP8 (`quant.dequant.scale_tiling`): W is float8_e4m3fn and each tile is scaled by its blocks of
    WS (`[N / BO, K / BI]`) in registers as it is used, so the kernel reads the FP8 bytes: one
    scale per row and block (`row_scaled`, KB blocks a tile), or one per element (`scaled_tile`).
    The GEMV mode keeps the scaled tile in fp32 (a rounding to X's dtype an element would bound it
    by the conversions, not the bytes), converted as loaded by `fp8_f32`'s PTX where FP8_ASM, and
    for one row over a scale a row and block (CHUNK > 1, `gemv_chunk`) sums runs of CHUNK
    products before scaling them (`chunk_scaled_dots`); the tensor-core tiles round it for the dot.
    PRELOAD (> 0, that one-row case without prologue or split, PRELOAD K steps in all): every tile
    and its scales loaded before the wait, held as FP8 bytes, no K loop (`preload_tiles`,
    `preloaded_dots`)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    tile = pid_m * tl.num_programs(0) + pid_n   # the output tile's semaphore and sums
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    W_DT = X.dtype.element_ty   # what a scaled FP8 tile is rounded to: the dot's operand
    if GEMV:
        W_DT = tl.float32
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
    if PRELOAD > 0:
        # The program's whole K range, loaded before waiting for the kernel before: a program of an
        # early launch streams its weights while that kernel runs.
        w0, s0, w1, s1, w2, s2, w3, s3 = preload_tiles(w_ptrs, WS, offs_n, mask_n, k_start, k_end, K, stride_wsn, BO,
                                                       BI, BLOCK_K, EVEN_K, KB, PRELOAD)
    elif GEMV:
        # The weights do not depend on the kernel before: the first tile is loaded before waiting
        # for it, and each later one a step ahead. FP8_ASM: carried into the next step as fp32
        # (`fp8_f32`), as FP8 bytes each is taken out of its register and packed back.
        w = _gemv_tile(w_ptrs, mask_n, k_start + offs_k < k_end, EVEN_K, FP8_ASM)
    if ADD_NORM or SILU_MUL:
        # With a prologue the next kernel is let in only after the main loop: let in at the start
        # (pdl_wait), it made the decode step slower than no PDL at all (bench/RESULTS.md).
        pdl_wait_only(PDL)
    else:
        pdl_wait(PDL)
    if LORA and GEMV and SPLIT_K == 1:
        # The deltas' operands are ready (the shrink ran before): their loads go out now, beside
        # the weights', rather than after the loop.
        d_sr, d_b = fma_delta_operands(LS, LB, LSCALE, token_slots(LSLOT, offs_m, mask_m, LSLOTS),
                                       offs_m.to(tl.int64), offs_n, mask_n, LR, LO1, LO2, LO3, N, stride_ls,
                                       stride_lbs, stride_lbn, stride_lsc, LORA_N, LBLOCK_R, not LORA_FP32)
    if GEMV:
        if BLOCK_M == 1:
            acc_k = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], dtype=tl.float32)
        else:
            acc_k = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ADD_NORM or SILU_MUL:
        # A prologue's input tiles are loaded one step ahead by hand: Triton's pipeliner prefetches
        # the loads that feed the dot, and these feed arithmetic first (one step's wait a step).
        ks = k_start + offs_k
        a, b = _prologue_tiles(X, D, offs_m, ks, mask_m[:, None] & (ks < k_end)[None, :], stride_xm, stride_dm, K,
                               ADD_NORM)
        if ADD_NORM:
            nw = tl.load(NW + ks, mask=ks < k_end, other=0.0)
    if PRELOAD > 0:
        acc_k += preloaded_dots(X, w0, s0, w1, s1, w2, s2, w3, s3, k_start, k_end, BLOCK_K, KB, CHUNK, FP8_ASM,
                                EVEN_K, PRELOAD)   # one row: X is its start
    else:
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + offs_k
            x_mask = tile_mask(mask_m, ks < k_end, EVEN_K)
            if not GEMV:
                w = weight_tile(w_ptrs, mask_n, ks < k_end, EVEN_K)
            if ADD_NORM or SILU_MUL:
                nxt = ks + BLOCK_K
                a_next, b_next = _prologue_tiles(X, D, offs_m, nxt, mask_m[:, None] & (nxt < k_end)[None, :], stride_xm,
                                                 stride_dm, K, ADD_NORM)
                if ADD_NORM:
                    nw_next = tl.load(NW + nxt, mask=nxt < k_end, other=0.0)
                    h = residual_add(a, b)
                    if pid_n == 0:
                        tl.store(H + offs_m[:, None] * stride_hm + ks[None, :], h, mask=x_mask)
                    x, h_sq = weighted_rows(h, nw)
                    sq += h_sq
                    nw = nw_next
                else:
                    x = silu_mul(a, b)
                a, b = a_next, b_next
            else:
                x = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :], mask=x_mask, other=0.0)
            if CHUNK > 1:   # the GEMV of one row over a scale a row and block: runs of products scaled at once
                acc_k += chunk_scaled_dots(w, tl.reshape(x.to(tl.float32), (BLOCK_K,)), WS, offs_n, mask_n, k0, K,
                                           stride_wsn, BO, BI, KB, CHUNK)
            else:
                if FP8 == 2:
                    wq = row_scaled(w, WS, offs_n, mask_n, k0, K, stride_wsn, BO, BI, W_DT, KB)
                else:
                    wq = scaled_tile(w, WS, offs_n[:, None], ks[None, :], mask_n[:, None] & (ks < k_end)[None, :],
                                     stride_wsn, BO, BI, W_DT, FP8)
                if GEMV and BLOCK_M == 1:
                    acc_k += wq.to(tl.float32) * x.to(tl.float32)
                elif GEMV:
                    acc_k += x.to(tl.float32)[:, None, :] * wq.to(tl.float32)[None, :, :]
                else:
                    if UPCAST:  # see interpreter_upcast()
                        x = x.to(tl.float32)
                        wq = wq.to(tl.float32)
                    acc += tl.dot(x, tl.trans(wq), input_precision=DOT_PRECISION)
            if GEMV and k0 + BLOCK_K < k_end:
                w = _gemv_tile(w_ptrs + BLOCK_K, mask_n, ks + BLOCK_K < k_end, EVEN_K, FP8_ASM)
            w_ptrs += BLOCK_K
    if GEMV:
        if BLOCK_M == 1:
            acc = tl.sum(acc_k, axis=1)[None, :]
        else:
            acc = tl.sum(acc_k, axis=2)
    if ADD_NORM or SILU_MUL:
        pdl_let_next_in(PDL)
    out_mask = mask_m[:, None] & mask_n[None, :]
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        if ADD_NORM:
            rstd = tl.rsqrt(sq / K + eps)
            acc = acc * rstd[:, None]
            if KEEP_NORMED:
                _store_normed(X, D, NW, NORMED, offs_m, mask_m, rstd, pid_n, NORMED_CHUNK, K, stride_xm, stride_dm,
                              stride_nm, BLOCK_K)
        if LORA and GEMV:
            acc = fma_delta_apply(acc.to(X.dtype.element_ty).to(tl.float32), d_sr, d_b)
        elif LORA:
            acc = lora_epilogue(acc.to(X.dtype.element_ty).to(tl.float32), offs_m, mask_m, offs_n, mask_n,
                                pid_n * BLOCK_N, N, LS, LB, LSCALE, LSLOT, LR, LSLOTS, LO1, LO2, LO3, stride_ls,
                                stride_lbs, stride_lbn, stride_lsc, LORA_N, BLOCK_N, LBLOCK_R, LSLOTS_PAD, LKC,
                                LORA_FP32, GEMV)
        tl.store(y_ptrs, acc.to(X.dtype.element_ty).to(Y.dtype.element_ty), mask=out_mask)
    else:
        # Partials laid out [SPLIT_K, M, N]; sums of squares [output tile, SPLIT_K, BLOCK_M].
        part_ptrs = Partials + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptrs + pid_k * M * N, acc, mask=out_mask)
        sum_ptrs = Sums + tile * SPLIT_K * BLOCK_M + tl.arange(0, BLOCK_M)
        if ADD_NORM:
            tl.store(sum_ptrs + pid_k * BLOCK_M, sq)
        # Every thread's partial store must precede the release below.
        tl.debug_barrier()
        arrived = tl.atomic_add(Semaphores + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            # Unrolled (no loop for the pipeliner to turn into async copies); .cg reads from L2,
            # which is coherent, never from a stale L1 line.
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptrs + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if ADD_NORM:
                sq = tl.zeros([BLOCK_M], dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    sq += tl.load(sum_ptrs + s * BLOCK_M, cache_modifier=".cg")
                rstd = tl.rsqrt(sq / K + eps)
                total = total * rstd[:, None]
                if KEEP_NORMED:
                    _store_normed(X, D, NW, NORMED, offs_m, mask_m, rstd, pid_n, NORMED_CHUNK, K, stride_xm,
                                  stride_dm, stride_nm, BLOCK_K)
            if LORA:
                total = lora_epilogue(total.to(X.dtype.element_ty).to(tl.float32), offs_m, mask_m, offs_n, mask_n,
                                      pid_n * BLOCK_N, N, LS, LB, LSCALE, LSLOT, LR, LSLOTS, LO1, LO2, LO3, stride_ls,
                                      stride_lbs, stride_lbn, stride_lsc, LORA_N, BLOCK_N, LBLOCK_R, LSLOTS_PAD, LKC,
                                      LORA_FP32, GEMV)
            tl.store(y_ptrs, total.to(X.dtype.element_ty).to(Y.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(Semaphores + tile, 0)


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None,
                         out: torch.Tensor | None = None, fp8: WeightScale | None = None) -> torch.Tensor:
    """x `[M, K]` (M <= `max_rows(N)`, last dim contiguous), weight `[N, K]` (last dim contiguous)
    -> `[M, N]` in x's dtype, or into `out` (`[M, N]`, rows contiguous, any float dtype: the
    result is rounded to x's dtype, then stored in out's). `config` overrides the heuristic
    (tests, the benchmark's sweep). `fp8`: weight is float8_e4m3fn with this block scale."""
    y = x.new_empty((x.shape[0], weight.shape[0])) if out is None else out
    _launch(x, weight, y, config, {}, fp8=fp8)
    return y


def _fp8_args(y: torch.Tensor, weight: torch.Tensor, fp8: WeightScale | None, block_k: int) -> dict:
    if fp8 is None:   # placeholders, never read
        return dict(WS=y, stride_wsn=0, BO=1, BI=1, FP8=0, KB=1)
    ks = kernel_scale(fp8.scale, fp8.block, *weight.shape, block_k)
    return dict(WS=ks.scale, stride_wsn=ks.scale.stride(0), BO=ks.bo, BI=ks.bi, FP8=ks.mode, KB=ks.kb)


def lora_args(y: torch.Tensor, lora: LoRAArgs | None) -> dict:
    """`lora_epilogue`'s kernel arguments (also the FP8 dense kernel's); placeholders without `lora`."""
    if lora is None:   # placeholders, never read
        return dict(LS=y, LB=y, LSCALE=y, LSLOT=y, LR=0, LSLOTS=0, LO1=0, LO2=0, LO3=0, stride_ls=0, stride_lbs=0,
                    stride_lbn=0, stride_lsc=0, LORA=False, LORA_N=1, LBLOCK_R=16, LSLOTS_PAD=1, LKC=16,
                    LORA_FP32=False)
    S, _, R = lora.b.shape
    o1, o2, o3 = lora.bounds
    return dict(LS=lora.s, LB=lora.b, LSCALE=lora.scale, LSLOT=lora.slot, LR=R, LSLOTS=S, LO1=o1, LO2=o2, LO3=o3,
                stride_ls=lora.s.stride(0), stride_lbs=lora.b.stride(0), stride_lbn=lora.b.stride(1),
                stride_lsc=lora.scale.stride(0), LORA=R > 0 and S > 0, LORA_N=lora.n_slices, LBLOCK_R=lora.block_r,
                LSLOTS_PAD=lora.slots_pad, LKC=lora.kc, LORA_FP32=lora.fp32_dot)


def skinny_linear_lora_triton(x: torch.Tensor, weight: torch.Tensor, lora: LoRAArgs,
                              config: SkinnyConfig | None = None, fp8: WeightScale | None = None) -> torch.Tensor:
    """`lora_expand(x @ weight.T, ...)` in one launch: the LoRA deltas of `lora` (the expand's
    arguments) added in the epilogue, rounded as the two ops round; `fp8` as `skinny_linear_triton`'s."""
    y = x.new_empty((x.shape[0], weight.shape[0]))
    _launch(x, weight, y, config, {}, lora, fp8)
    return y


def add_rms_norm_linear_triton(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                               weight: torch.Tensor, keep_normed: bool, config: SkinnyConfig | None = None,
                               lora: LoRAArgs | None = None, fp8: WeightScale | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """h = x + delta, normed = RMSNorm(h) * norm_weight, y = normed @ weight.T in one launch:
    returns (y, h, normed if keep_normed else None). x and delta `[M, K]`, last dims contiguous.
    `lora`: LoRA deltas added in the epilogue, as `skinny_linear_lora_triton`'s; `fp8` as
    `skinny_linear_triton`'s."""
    M, K = x.shape
    y = x.new_empty((M, weight.shape[0]))
    h = x.new_empty((M, K))
    normed = x.new_empty((M, K)) if keep_normed else None
    _launch(x, weight, y, config, dict(
        D=delta, NW=norm_weight, H=h, NORMED=normed if keep_normed else y, eps=eps,
        stride_dm=delta.stride(0), stride_hm=K, stride_nm=K, ADD_NORM=True, KEEP_NORMED=keep_normed), lora, fp8)
    return y, h, normed


def silu_mul_linear_triton(gate_up: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None,
                           lora: LoRAArgs | None = None, fp8: WeightScale | None = None) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T in one launch; gate_up `[M, 2K]` holds [gate | up], weight `[N, K]`.
    `lora`: LoRA deltas added in the epilogue, as `skinny_linear_lora_triton`'s; `fp8` as
    `skinny_linear_triton`'s."""
    y = gate_up.new_empty((gate_up.shape[0], weight.shape[0]))
    _launch(gate_up, weight, y, config, dict(SILU_MUL=True), lora, fp8)
    return y


def _launch(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, config: SkinnyConfig | None,
            prologue: dict, lora: LoRAArgs | None = None, fp8: WeightScale | None = None) -> None:
    """One launch writing y; `prologue`: the ADD_NORM / SILU_MUL arguments that differ from none;
    `lora`: the epilogue's deltas; `fp8`: the weight's block scale."""
    M = x.shape[0]
    N, K = weight.shape
    if config is None:
        if M > max_rows(N):
            raise ValueError(f"skinny linear: M={M} rows, at most {max_rows(N)} for a weight of {N} rows")
        config = skinny_config(M, N, K, num_sms(x.device), PROLOGUE_MAX_STEPS if prologue else 0,
                               weight.element_size())
    else:
        check_config(config, M, N)
    block_n, block_k, split_k, num_warps, num_stages, gemv = config
    ws = split_workspace(x.device) if split_k > 1 else None
    partials, semaphores, sums = ws if ws is not None else (y, y, y)  # never read when SPLIT_K == 1
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    upcast = interpreter_upcast(x.dtype)
    precision = "ieee" if upcast or x.dtype == torch.float32 else "tf32"
    block_m = row_tile(M, gemv)
    grid = (triton.cdiv(N, block_n), split_k, triton.cdiv(M, block_m))
    args = dict(D=y, NW=y, H=y, NORMED=y, eps=0.0, stride_dm=0, stride_hm=0, stride_nm=0,
                ADD_NORM=False, SILU_MUL=False, KEEP_NORMED=False)
    args.update(prologue)
    args.update(lora_args(y, lora))
    args.update(_fp8_args(y, weight, fp8, block_k))
    one_row = gemv and M == 1
    args.update(FP8_ASM=gemv and fp8 is not None and fp8_convert_asm(x.device),
                CHUNK=gemv_chunk(args["FP8"], args["BI"], block_k) if one_row else 1)
    args.update(PRELOAD=preload_steps(config, M, K, args["CHUNK"], bool(prologue)))
    _skinny_kernel[grid](
        x, weight, y, partials, semaphores, M, N, K, k_per_split, x.stride(0), weight.stride(0), y.stride(0),
        Sums=sums, NORMED_CHUNK=triton.cdiv(K, grid[0]), **args,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        EVEN_K=K % block_k == 0, UPCAST=upcast, DOT_PRECISION=precision, GEMV=gemv, num_warps=num_warps,
        num_stages=num_stages,
        **launch_kwargs(x.device))
