"""Multi-LoRA shrink and expand (Triton): one launch each serves a batch whose tokens use different adapters.

The adapters live in a slot pool: `a [S, N*R, in]`, `b [S, out, R]`, one slot per adapter, ranks
zero-padded to the pool's R. Each token names its slot (`slot [T]`, -1: no adapter; a slot
outside [0, S) counts as none). The ops and their torch references are in `lora.py`. Neither
kernel needs segment metadata: they read `slot` as the runtime uploads it, with no sort, no host
sync and no allocation besides the output (safe to capture in a CUDA graph).

`_lora_shrink_kernel`, s[t, n] = sum_k x[t, k] a[slot_t, n, k] (fp32): a grid over (token
blocks, column blocks of N*R, (S + 1) slots x SPLIT_K). Program (t, n, s, k) takes the rows of
token block t whose slot is s and runs a tensor-core dot over its K range with slot s's weights
(fp32 accumulation); grid slot -1 writes the zeros of the rows without an adapter. A program
whose slot is absent from its block exits after loading the block's slot ids. Why this rather
than SGMV segments (an argsort by slot and CSR offsets): at decode (T <= 256, one token a
request) a block holds a few slots and each present slot reads its weight slice once a token
block, `N*R x in` (qkv at R = 16: 48 x 2048 bf16 = 192 KiB, mostly from L2), which costs less
than the sort and the metadata launches; at prefill a request's tokens are contiguous, a block
holds one or two slots, and the grid behaves as SGMV's does. x's loads are masked to the
program's rows, so each row is read once per column block. A decode batch has few blocks, so
the K range is split (SPLIT_K, `shrink_config`) so that enough programs stream the weights: each
split writes fp32 partials to a workspace and bumps its group's semaphore, and the last to
arrive sums them in split order (deterministic), stores the rows and puts the semaphore back to
0 (the skinny GEMM's scheme; the workspace is allocated once per device, before any capture).

At one row (`GEMV_MAX_T`) the shrink takes `_lora_shrink_gemv_kernel` instead: one column of A a
program, multiplied in registers, no slot grid or split.

`_lora_expand_kernel`, out[t, c] = y[t, c] + scale[slot_t, i] * sum_r s[t, i*R + r] b[slot_t, c, r]
for column c in slice i: a grid over (token blocks, column blocks). A program loads its y tile
once and adds every row's delta: one dot of K = R where the block's rows share one slot (a
prefill's tokens), else with the slots stacked along K (k = slot * R + r): the rows' s
go into a `[rows, KC]` tile that is zero outside each row's own slot block (times that slot's
scale), every slot's B rows into a `[KC, columns]` tile (slots absent from the block masked, so
never read), one dot per KC of K; all slots' loads go out together. A column block crossing
slices does this per slice it meets (B masked to the slice's columns); the slice boundaries are
scalar arguments (at most MAX_SLICES slices: q, k, v). Rows without an adapter are y's bits.

Measured on an H100 (bf16, R = 16, S = 8, slots drawn from -1..7, CUDA graphs), shrink + expand
against the base linear (cuBLAS): Qwen3-30B-A3B's qkv (2048 -> 4096 + 512 + 512) at 1 / 64 /
512 tokens 6.3 / 13.9 / 31.8 µs against 6.9 / 6.5 / 17.4; o_proj (4096 -> 2048) 6.7 / 12.1 /
26.3 against 7.5 / 8.5 / 17.0.

16-bit x and a run the shrink's dot in that dtype, fp32 in IEEE fp32. The expand's dot takes s
times the scale rounded to b's dtype when b is 16-bit (fp32 in IEEE fp32 for fp32 b and under
the interpreter), adds y in fp32 and rounds once to y's dtype."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from compiled.linear import LORA_MAX_SLICES as MAX_SLICES
from compiled.linear import workspace
from compiled.triton_utils import (interpreter_upcast, interpreting, launch_kwargs, masked_dot_t, pdl_wait,
                                   residual_add, silu_mul, slot_stacked_delta, split_k_store, weighted_rows)

MIN_BLOCK = 16   # tl.dot's smallest tile side
MAX_SPLIT_K = 16
MIN_K_PER_SPLIT = 256
SPLIT_MAX_T = 64          # the shrink splits K up to this many tokens (one token block)
SPLIT_PROGRAMS = 64       # ... until token blocks x column blocks x splits reach this many
DELTA_K_STEP = 128        # the expand's stacked-slot dots: this many of K (slots x rank) a dot
WORKSPACE_FLOATS = MAX_SPLIT_K * SPLIT_MAX_T * 1024   # split partials SPLIT_K x T x N*R, fp32 (N*R <= 1024)
SEMAPHORES = 1 << 14      # one per (token block, column block, slot) of a split launch
GEMV_MAX_T = 1            # the shrink's rows for its GEMV mode (it serves more: a forced config)
GEMV_K_ELEMENTS = 4096    # GEMV mode: K elements a row a step (one step for every decode linear)


class LoRAConfig(NamedTuple):
    block_t: int
    block_n: int
    block_k: int       # the shrink's K step (the expand's: DELTA_K_STEP)
    split_k: int = 1   # the shrink's K splits
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False  # the shrink's GEMV mode (`_lora_shrink_gemv_kernel`)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def shrink_config(T: int, NR: int, K: int) -> LoRAConfig:
    """Up to GEMV_MAX_T rows: the GEMV mode, one column a program, all of K in one step (up to
    GEMV_K_ELEMENTS). Otherwise token blocks of up to 64 rows (fewer blocks: each slot's weights
    read fewer times); up to SPLIT_MAX_T tokens, 16-column blocks and K split in powers of two
    while each split keeps MIN_K_PER_SPLIT and the blocks x splits stay within SPLIT_PROGRAMS (a
    slot's weights streamed by that many programs). An H100 sweep of splits and column blocks at
    8 and 64 tokens (qkv, o, gate/up at R = 16, S = 8) put this within ~1 µs of the best (o at
    one token: 9.3 µs unsplit, 3.6 split 16 ways)."""
    if T <= GEMV_MAX_T:
        return gemv_shrink_config(T, K)
    block_t = _pow2(T, MIN_BLOCK, 64)
    block_n = MIN_BLOCK if T <= SPLIT_MAX_T else _pow2(NR, MIN_BLOCK, 64)
    block_k = _pow2(K, MIN_BLOCK, 128)
    split = 1
    if T <= SPLIT_MAX_T:
        blocks = triton.cdiv(T, block_t) * triton.cdiv(NR, block_n)
        while (2 * split <= MAX_SPLIT_K and K // (2 * split) >= MIN_K_PER_SPLIT
               and blocks * 2 * split <= SPLIT_PROGRAMS):
            split *= 2
    return LoRAConfig(block_t, block_n, block_k, split)


def gemv_shrink_config(T: int, K: int, block_n: int = 1) -> LoRAConfig:
    block_t = triton.next_power_of_2(T)
    return LoRAConfig(block_t, block_n, _pow2(K, 1, GEMV_K_ELEMENTS // (block_t * block_n)), 1, 4, 1, True)


def expand_config(T: int, OUT: int) -> LoRAConfig:
    """Token blocks of up to 64 rows, 64 columns a program (the best or within ~1 µs of it in an
    H100 sweep of 16-64 rows x 32-128 columns at 8-512 tokens: qkv, o, gate/up; R = 16, S = 8),
    128 columns past SPLIT_MAX_T tokens (H200, 2,048 tokens of one adapter: qkv 28.7 -> 20.8 µs,
    o 8.8 -> 7.8)."""
    return LoRAConfig(_pow2(T, MIN_BLOCK, 64), _pow2(OUT, MIN_BLOCK, 64 if T <= SPLIT_MAX_T else 128), DELTA_K_STEP)


def _check_config(config: LoRAConfig) -> None:
    smallest = 1 if config.gemv else MIN_BLOCK   # tl.dot's minimum does not bind the GEMV mode
    for name in ("block_t", "block_n", "block_k"):
        v = getattr(config, name)
        if v < smallest or v & (v - 1):
            raise ValueError(f"lora kernels: {name}={v} must be a power of two >= {smallest}")
    if not 1 <= config.split_k <= MAX_SPLIT_K:
        raise ValueError(f"lora kernels: split_k={config.split_k} must be in 1..{MAX_SPLIT_K}")


class SplitWorkspace(NamedTuple):
    partials: torch.Tensor    # fp32 [WORKSPACE_FLOATS]
    semaphores: torch.Tensor  # int32 [SEMAPHORES], all zero between launches


SHRINK_KERNEL = "lora shrink"   # its name in the workspace registry (`workspace.py`)


def _allocate_workspace(device: torch.device) -> SplitWorkspace:
    return SplitWorkspace(torch.empty(WORKSPACE_FLOATS, dtype=torch.float32, device=device),
                          torch.zeros(SEMAPHORES, dtype=torch.int32, device=device))


def split_workspace(device: torch.device) -> SplitWorkspace:
    """One per device, allocated at the first split launch and never again; that launch must
    come before any CUDA graph capture (`workspace.py` says why)."""
    return workspace.split_workspace(SHRINK_KERNEL, device, _allocate_workspace)


@triton.jit
def token_slots(SLOT, offs_t, in_t, S):
    """The tokens' slots, -1 for no adapter, slots outside [0, S) and tokens past T."""
    slots = tl.load(SLOT + offs_t, mask=in_t, other=-1).to(tl.int32)
    return tl.where(in_t & (slots >= 0) & (slots < S), slots, -1)


@triton.jit
def _lora_shrink_kernel(X, A, OUT, SLOT, Partials, Semaphores, T, NR, K, S, K_PER_SPLIT,
                        stride_xt, stride_as, stride_an, stride_ot,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """OUT `[T, NR]` fp32; X `[T, K]`, A `[S, NR, K]` (last dims contiguous). Grid axis 2 is
    (slot + 1) * SPLIT_K + split. EVEN_K: K and K_PER_SPLIT are whole BLOCK_K steps."""
    pdl_wait(PDL)
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2) // SPLIT_K - 1
    pid_k = tl.program_id(2) % SPLIT_K
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = offs_t < T
    rows = in_t & (token_slots(SLOT, offs_t, in_t, S) == s)
    if tl.sum(rows.to(tl.int32), axis=0) > 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = offs_n < NR
        o_ptrs = OUT + offs_t.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
        o_mask = rows[:, None] & in_n[None, :]
        if s < 0:
            if pid_k == 0:
                tl.store(o_ptrs, tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32), mask=o_mask)
        else:
            offs_k = tl.arange(0, BLOCK_K)
            k_start = pid_k * K_PER_SPLIT
            k_end = tl.minimum(k_start + K_PER_SPLIT, K)
            x_ptrs = X + offs_t.to(tl.int64)[:, None] * stride_xt + (k_start + offs_k)[None, :]
            a_ptrs = (A + s.to(tl.int64) * stride_as + offs_n.to(tl.int64)[:, None] * stride_an
                      + (k_start + offs_k)[None, :])
            acc = masked_dot_t(tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32), x_ptrs, a_ptrs, rows, in_n,
                               k_start, k_end, BLOCK_K, EVEN_K, UPCAST, PRECISION)
            # partials [SPLIT_K, T, NR]; rows of other slots are other programs' (disjoint)
            part_ptrs = Partials + offs_t.to(tl.int64)[:, None] * NR + offs_n[None, :]
            sem = Semaphores + (pid_t * tl.num_programs(1) + pid_n) * S + s
            split_k_store(acc, o_ptrs, part_ptrs, T * NR, o_mask, sem, pid_k, SPLIT_K)


@triton.jit
def _lora_shrink_gemv_kernel(X, A, OUT, SLOT, T, NR, K, S, stride_xt, stride_as, stride_an, stride_ot,
                             D, NW, eps, stride_dt, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, ADD_NORM: tl.constexpr, SILU_MUL: tl.constexpr,
                             PDL: tl.constexpr):
    """The shrink's GEMV mode, for a few rows: a program owns BLOCK_N columns of every row, each
    row's own slot's A rows go straight into registers and are multiplied there by the row (no
    tensor-core tile, no slot grid, no split), summed along K once after the loop. At one decode
    row this is a column or two of A a program, one load of all of K: the launch takes about as
    long as one memory round trip, where the tiled kernel's slot grid and split took two or three.

    Prologues, as the skinny GEMM's (so that the linear after it reads the same input): ADD_NORM,
    the rows are RMSNorm(X + D) * NW (each program sums the squares itself: it reads all of K);
    SILU_MUL, X is `[T, 2K]` [gate | up] and the rows are silu(gate) * up."""
    pdl_wait(PDL)
    offs_t = tl.arange(0, BLOCK_T)
    in_t = offs_t < T
    t64 = offs_t.to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < NR
    offs_k = tl.arange(0, BLOCK_K)
    slots = token_slots(SLOT, offs_t, in_t, S)
    has = slots >= 0
    a_rows = (A + tl.where(has, slots, 0).to(tl.int64)[:, None, None] * stride_as
              + offs_n.to(tl.int64)[None, :, None] * stride_an)
    a_mask = has[:, None, None] & in_n[None, :, None]
    acc = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        in_k = ks < K
        x_mask = in_t[:, None] & in_k[None, :]
        x = tl.load(X + t64[:, None] * stride_xt + ks[None, :], mask=x_mask, other=0.0)
        a = tl.load(a_rows + ks[None, None, :], mask=a_mask & in_k[None, None, :], other=0.0,
                    eviction_policy="evict_last")
        if ADD_NORM:
            h = residual_add(x, tl.load(D + t64[:, None] * stride_dt + ks[None, :], mask=x_mask, other=0.0))
            x, h_sq = weighted_rows(h, tl.load(NW + ks, mask=in_k, other=0.0))
            sq += h_sq
        elif SILU_MUL:
            x = silu_mul(x, tl.load(X + t64[:, None] * stride_xt + (K + ks)[None, :], mask=x_mask, other=0.0))
        acc += x.to(tl.float32)[:, None, :] * a.to(tl.float32)
    s = tl.sum(acc, axis=2)
    if ADD_NORM:
        s = s * tl.rsqrt(sq / K + eps)[:, None]
    tl.store(OUT + t64[:, None] * stride_ot + offs_n[None, :], s, mask=in_t[:, None] & in_n[None, :])


@triton.jit
def slice_start(i: tl.constexpr, O1, O2, O3, OUT, N: tl.constexpr):
    """Column where slice i starts (i = N: the end)."""
    if i == 0:
        return 0
    elif i == N:
        return OUT
    elif i == 1:
        return O1
    elif i == 2:
        return O2
    else:
        return O3


@triton.jit
def _lora_expand_kernel(Y, SIN, B, SCALE, SLOT, OUT_PTR, T, OUT, R, S, O1, O2, O3,
                        stride_yt, stride_st, stride_bs, stride_bo, stride_ss, stride_ot,
                        N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
                        SLOTS_PAD: tl.constexpr, KC: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr):
    """OUT_PTR `[T, OUT]` = Y + the LoRA delta of each row's slot; SIN `[T, N*R]` fp32, B
    `[S, OUT, R]`, SCALE `[S, N]` fp32; slice i is columns [bound(i), bound(i + 1))."""
    pdl_wait(PDL)
    pid_t = tl.program_id(0)
    pid_o = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = offs_t < T
    t64 = offs_t.to(tl.int64)
    slots = token_slots(SLOT, offs_t, in_t, S)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    in_o = offs_o < OUT
    mask = in_t[:, None] & in_o[None, :]
    y = tl.load(Y + t64[:, None] * stride_yt + offs_o[None, :], mask=mask, other=0.0)
    acc = add_slice_deltas(y.to(tl.float32), SIN, B, SCALE, slots, t64, offs_o, in_o, pid_o * BLOCK_O, R, O1, O2, O3,
                           OUT, stride_st, stride_bs, stride_bo, stride_ss, N, BLOCK_O, BLOCK_R, SLOTS_PAD, KC,
                           FP32_DOT, False)
    tl.store(OUT_PTR + t64[:, None] * stride_ot + offs_o[None, :], acc.to(y.dtype), mask=mask)


@triton.jit
def add_slice_deltas(acc, SIN, B, SCALE, slots, rows64, offs_o, in_o, block_lo, R, O1, O2, O3, OUT,
                     stride_st, stride_bs, stride_bo, stride_ss, N: tl.constexpr, BLOCK_O: tl.constexpr,
                     BLOCK_R: tl.constexpr, SLOTS_PAD: tl.constexpr, KC: tl.constexpr, FP32_DOT: tl.constexpr,
                     FMA: tl.constexpr):
    """acc `[rows, BLOCK_O]` (fp32, columns offs_o from block_lo) + each row's delta, slice by
    slice: the expand's arithmetic, shared with the skinny GEMM's LoRA epilogue. FMA: without
    tensor-core dots (a tile of fewer than 16 rows or columns: the GEMV mode), every slice at once."""
    if tl.sum((slots >= 0).to(tl.int32), axis=0) > 0:
        if FMA:
            sr, b = fma_delta_operands(SIN, B, SCALE, slots, rows64, offs_o, in_o, R, O1, O2, O3, OUT, stride_st,
                                       stride_bs, stride_bo, stride_ss, N, BLOCK_R, not FP32_DOT)
            acc = fma_delta_apply(acc, sr, b)
        else:
            for i in tl.static_range(N):
                lo = slice_start(i, O1, O2, O3, OUT, N)
                hi = slice_start(i + 1, O1, O2, O3, OUT, N)
                if (lo < block_lo + BLOCK_O) & (hi > block_lo):
                    cols = in_o & (offs_o >= lo) & (offs_o < hi)
                    acc = slot_stacked_delta(acc, SIN, B, SCALE, slots, rows64, offs_o, cols, 0, i * R, R,
                                             stride_st, stride_bs, 0, stride_bo, stride_ss, i, SLOTS_PAD, BLOCK_R,
                                             KC, "ieee", not FP32_DOT)
    return acc


@triton.jit
def fma_delta_operands(S_IN, B, SCALE, slots, rows64, offs_o, in_o, R, O1, O2, O3, OUT, stride_s, stride_bs,
                       stride_bo, stride_scale, N: tl.constexpr, BLOCK_R: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """What `add_slice_deltas`' FMA path multiplies, loaded in one go so that the loads can go out
    early (`fma_delta_apply` adds them later): for each row and column, the row's rank-R shrink
    output of the column's slice times that slice's scale (rounded to B's dtype when
    LOW_PRECISION, as there), `[rows, BLOCK_R, columns]`, and B's `[rows, BLOCK_R, columns]`."""
    sl = tl.zeros(offs_o.shape, dtype=tl.int32)   # each column's slice
    for i in tl.static_range(1, N):
        sl += (offs_o >= slice_start(i, O1, O2, O3, OUT, N)).to(tl.int32)
    r = tl.arange(0, BLOCK_R)
    has = slots >= 0
    slot64 = tl.where(has, slots, 0).to(tl.int64)
    mask = has[:, None, None] & (r < R)[None, :, None] & in_o[None, None, :]
    sr = tl.load(S_IN + rows64[:, None, None] * stride_s + (sl * R)[None, None, :] + r[None, :, None], mask=mask,
                 other=0.0)
    sc = tl.load(SCALE + slot64[:, None] * stride_scale + sl[None, :], mask=has[:, None] & in_o[None, :], other=0.0)
    b = tl.load(B + slot64[:, None, None] * stride_bs + offs_o.to(tl.int64)[None, None, :] * stride_bo
                + r[None, :, None], mask=mask, other=0.0)
    sr = sr * sc[:, None, :]
    if LOW_PRECISION:
        sr = sr.to(b.dtype)
    return sr, b


@triton.jit
def fma_delta_apply(acc, sr, b):
    """acc + the deltas of `fma_delta_operands`' operands (the FMA path's arithmetic)."""
    return acc + tl.sum(sr.to(tl.float32) * b.to(tl.float32), axis=1)


@triton.jit
def row_delta_added(y, SIN, B, SCALE, SLOT, row, cols, in_cols, R, S, stride_st, stride_bs, stride_bo, stride_ss,
                    BLOCK_R: tl.constexpr, R_STEP: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """One row's tile y (columns `cols` of a one-slice expand) plus its slot's delta, rounded to
    y's dtype as the expand rounds it (s times the scale rounded to B's dtype when LOW_PRECISION).
    B is read R_STEP ranks at a time, so that a whole row of a hidden-size output stays in registers."""
    slot = tl.load(SLOT + row).to(tl.int32)
    if (slot >= 0) & (slot < S):
        b_rows = B + slot.to(tl.int64) * stride_bs + cols.to(tl.int64)[:, None] * stride_bo
        scale = tl.load(SCALE + slot * stride_ss)
        delta = tl.zeros(y.shape, dtype=tl.float32)
        for r0 in tl.static_range(0, BLOCK_R, R_STEP):
            r = r0 + tl.arange(0, R_STEP)
            sr = tl.load(SIN + row * stride_st + r, mask=r < R, other=0.0) * scale
            b = tl.load(b_rows + r[None, :], mask=in_cols[:, None] & (r < R)[None, :], other=0.0)
            if LOW_PRECISION:
                sr = sr.to(b.dtype)
            delta += tl.sum(b.to(tl.float32) * sr.to(tl.float32)[None, :], axis=1)
        y = (y.to(tl.float32) + delta).to(y.dtype)
    return y


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slot: torch.Tensor,
                       config: LoRAConfig | None = None) -> torch.Tensor:
    """x `[T, in]`, a `[S, N*R, in]`, slot `[T]` -> `[T, N*R]` fp32 (shapes checked by the op).
    `config` overrides `shrink_config` (tests)."""
    T, K = x.shape
    S, NR, _ = a.shape
    out = torch.empty((T, NR), dtype=torch.float32, device=x.device)
    if T == 0 or NR == 0:
        return out
    if K == 0 or S == 0:
        return out.zero_()
    x, a = _last_dim_contiguous(x), _last_dim_contiguous(a)
    cfg = config or shrink_config(T, NR, K)
    _check_config(cfg)
    if cfg.gemv:
        return _shrink_gemv(x, a, slot, out, cfg, {})
    grid_tn = (triton.cdiv(T, cfg.block_t), triton.cdiv(NR, cfg.block_n))
    split = cfg.split_k
    ws = None
    if split > 1 and split * T * NR <= WORKSPACE_FLOATS and grid_tn[0] * grid_tn[1] * S <= SEMAPHORES:
        ws = split_workspace(x.device)
    if ws is None:
        split = 1
    partials, semaphores = ws if ws is not None else (out, out)   # never read unsplit
    k_per_split = triton.cdiv(triton.cdiv(K, split), cfg.block_k) * cfg.block_k
    upcast = interpreter_upcast(x.dtype)
    _lora_shrink_kernel[(*grid_tn, (S + 1) * split)](
        x, a, out, slot, partials, semaphores, T, NR, K, S, k_per_split,
        x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, EVEN_K=K % cfg.block_k == 0,
        UPCAST=upcast, PRECISION="ieee" if upcast or x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(x.device))
    return out


def _shrink_gemv(x: torch.Tensor, a: torch.Tensor, slot: torch.Tensor, out: torch.Tensor, cfg: LoRAConfig,
                 prologue: dict) -> torch.Tensor:
    """One GEMV-mode shrink launch into out; `prologue`: the ADD_NORM / SILU_MUL arguments."""
    T, NR, K = out.shape[0], a.shape[1], a.shape[2]
    args = dict(D=x, NW=x, eps=0.0, stride_dt=0, ADD_NORM=False, SILU_MUL=False)
    args.update(prologue)
    _lora_shrink_gemv_kernel[(triton.cdiv(NR, cfg.block_n),)](
        x, a, out, slot, T, NR, K, a.shape[0], x.stride(0), a.stride(0), a.stride(1), out.stride(0), **args,
        BLOCK_T=triton.next_power_of_2(T), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch_kwargs(x.device))
    return out


def shrink_after_norm_triton(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             a: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """`lora_shrink(RMSNorm(x + delta) * norm_weight, a, slot)` in one GEMV-mode launch, the normed
    rows as the skinny GEMM's ADD_NORM prologue makes them (x, delta `[T, K]`, last dims contiguous)."""
    return _prologue_shrink(x, a, slot, x.shape[1],
                            dict(D=delta, NW=norm_weight, eps=eps, stride_dt=delta.stride(0), ADD_NORM=True))


def shrink_after_silu_triton(gate_up: torch.Tensor, a: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """`lora_shrink(silu(gate) * up, a, slot)` in one GEMV-mode launch; gate_up `[T, 2K]`."""
    return _prologue_shrink(gate_up, a, slot, gate_up.shape[1] // 2, dict(SILU_MUL=True))


def _prologue_shrink(x: torch.Tensor, a: torch.Tensor, slot: torch.Tensor, K: int, prologue: dict) -> torch.Tensor:
    out = torch.empty((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    if x.shape[0] == 0 or a.shape[1] == 0:
        return out
    return _shrink_gemv(x, _last_dim_contiguous(a), slot, out, gemv_shrink_config(x.shape[0], K), prologue)


class LoRAArgs(NamedTuple):
    """What a launch adding the expand's deltas takes besides its tiles (the expand kernel, the
    skinny GEMM's epilogue): the tensors (last dims contiguous) and their kernel constants."""
    s: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor
    slot: torch.Tensor
    bounds: list[int]      # where slices 1..MAX_SLICES-1 start
    n_slices: int
    block_r: int
    slots_pad: int
    kc: int                # the stacked-slot dots' K step
    fp32_dot: bool

    @classmethod
    def of(cls, s: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slot: torch.Tensor, slices: list[int],
           k_step: int = DELTA_K_STEP) -> "LoRAArgs":
        if len(slices) > MAX_SLICES:
            raise ValueError(f"lora_expand: {len(slices)} slices, the kernel takes at most {MAX_SLICES}")
        s, b, scale = (_last_dim_contiguous(t) for t in (s, b, scale))
        block_r = _pow2(b.shape[2], MIN_BLOCK, 1 << 30)
        slots_pad = triton.next_power_of_2(b.shape[0])
        return cls(s, b, scale, slot, [sum(slices[:i]) for i in range(1, MAX_SLICES)], len(slices), block_r,
                   slots_pad, min(k_step, slots_pad * block_r), b.dtype == torch.float32 or interpreting())


def lora_expand_triton(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slot: torch.Tensor,
                       slices: list[int], config: LoRAConfig | None = None) -> torch.Tensor:
    """y `[T, out]`, s `[T, N*R]` fp32, b `[S, out, R]`, scale `[S, N]` fp32, slot `[T]` ->
    y + delta, a new `[T, out]` tensor in y's dtype (shapes checked by the op). `config`
    overrides `expand_config` (its block_k: the stacked-slot K step)."""
    T, OUT = y.shape
    S, _, R = b.shape
    cfg = config or expand_config(T, OUT)
    _check_config(cfg)
    la = LoRAArgs.of(s, b, scale, slot, slices, cfg.block_k)
    out = torch.empty((T, OUT), dtype=y.dtype, device=y.device)
    if T == 0 or OUT == 0:
        return out
    if R == 0 or S == 0:
        return out.copy_(y)
    y = _last_dim_contiguous(y)
    _lora_expand_kernel[(triton.cdiv(T, cfg.block_t), triton.cdiv(OUT, cfg.block_n))](
        y, la.s, la.b, la.scale, slot, out, T, OUT, R, S, *la.bounds,
        y.stride(0), la.s.stride(0), la.b.stride(0), la.b.stride(1), la.scale.stride(0), out.stride(0),
        N=la.n_slices, BLOCK_T=cfg.block_t, BLOCK_O=cfg.block_n, BLOCK_R=la.block_r, SLOTS_PAD=la.slots_pad,
        KC=la.kc, FP32_DOT=la.fp32_dot, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(y.device))
    return out
