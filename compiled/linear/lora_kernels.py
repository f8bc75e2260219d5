"""Multi-LoRA shrink and expand (Triton): one launch each serves a batch whose tokens use different adapters.

The adapters live in a slot pool: `a [S, N*R, in]`, `b [S, out, R]`, one slot per adapter, ranks
zero-padded to the pool's R. Each token names its slot (`slot [T]`, -1: no adapter). The ops and
their torch references are in `lora.py`.

Design: a grid over (token blocks, column blocks, S + 1 slots). Program (t, n, s) takes the rows
of token block t whose slot is s and computes their columns of block n with slot s's weights as a
tensor-core tile (`tl.dot`, fp32 accumulation); program s = -1 (grid index 0) takes the rows
without an adapter (or with a slot outside [0, S)): zeros for the shrink, y copied for the
expand. So every output row is written by exactly one program, the result is deterministic, and
no segment metadata is needed: the kernels read `slot` as the runtime uploads it, with no sort,
no host sync and no allocation besides the output (safe to capture in a CUDA graph).

Why this rather than SGMV segments (tokens grouped by slot with an argsort and CSR offsets):
at decode (T <= 256, one token a request) a token block holds a few slots and a program whose
slot is absent from its block exits after loading T slot ids; present slots read their weight
slice once per token block, `N*R x in` (qkv at R = 16: 48 x 2048 bf16 = 192 KiB) from L2, which
at these sizes costs less than the argsort and the metadata launches it would save. At prefill
a request's tokens are contiguous, so a block holds one or two slots: the grid behaves as SGMV's
does, with no sort. The loads of x / y / s are masked to the program's rows, so each row is read
once in all; the rows of other slots cost only wasted MMA lanes.

* `_lora_shrink_kernel`: s[t, n] = sum_k x[t, k] a[slot, n, k] (fp32 out), K in BLOCK_K steps.
* `_lora_expand_kernel`: out[t, c] = y[t, c] + scale[slot, i] * sum_r s[t, i*R + r] b[slot, c, r]
  for column c in slice i; a column block crossing slices runs one dot per slice it meets (the
  b tile masked to the slice's columns), a block outside a slice skips it. Slice boundaries are
  scalar arguments (at most MAX_SLICES slices: q/k/v).

16-bit x and a run their dot in that dtype; fp32 in IEEE fp32. The expand multiplies its fp32 s
by the scale and dots it with b upcast to fp32 (TF32 on the GPU for 16-bit b, whose values TF32
holds exactly; IEEE for fp32), then adds y in fp32 and rounds once to y's dtype."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from compiled.linear import LORA_MAX_SLICES as MAX_SLICES
from compiled.triton_utils import interpreter_upcast, interpreting, launch_kwargs, pdl_wait

MIN_BLOCK = 16   # tl.dot's smallest tile side


class LoRAConfig(NamedTuple):
    block_t: int
    block_n: int
    block_k: int       # the shrink's K step (the expand's rank tile is R rounded up: unused there)
    num_warps: int = 4
    num_stages: int = 3


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def shrink_config(T: int, NR: int, K: int) -> LoRAConfig:
    """Token blocks of up to 64 rows (fewer blocks: each slot's weights read fewer times); at
    16 tokens or fewer, 16-column blocks to spread the weight over more programs."""
    block_t = _pow2(T, MIN_BLOCK, 64)
    block_n = MIN_BLOCK if T <= 16 else _pow2(NR, MIN_BLOCK, 64)
    return LoRAConfig(block_t, block_n, _pow2(K, MIN_BLOCK, 128))


def expand_config(T: int, OUT: int) -> LoRAConfig:
    """Token blocks of up to 64 rows, 64 columns a program."""
    return LoRAConfig(_pow2(T, MIN_BLOCK, 64), _pow2(OUT, MIN_BLOCK, 64), MIN_BLOCK)


def _check_config(config: LoRAConfig) -> None:
    for name in ("block_t", "block_n", "block_k"):
        v = getattr(config, name)
        if v < MIN_BLOCK or v & (v - 1):
            raise ValueError(f"lora kernels: {name}={v} must be a power of two >= {MIN_BLOCK}")


@triton.jit
def _slot_rows(SLOT, pid_t, T, S, BLOCK_T: tl.constexpr):
    """This program's slot s (-1 for grid index 0), its token offsets, and which of them are its rows."""
    s = tl.program_id(2) - 1
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = offs_t < T
    slots = tl.load(SLOT + offs_t, mask=in_t, other=-1).to(tl.int32)
    slots = tl.where((slots >= 0) & (slots < S), slots, -1)
    return s, offs_t, in_t & (slots == s)


@triton.jit
def _lora_shrink_kernel(X, A, OUT, SLOT, T, NR, K, S, stride_xt, stride_as, stride_an, stride_ot,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """OUT `[T, NR]` fp32; X `[T, K]`, A `[S, NR, K]` (last dims contiguous)."""
    pdl_wait(PDL)
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    s, offs_t, rows = _slot_rows(SLOT, pid_t, T, S, BLOCK_T)
    if tl.sum(rows.to(tl.int32), axis=0) > 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = offs_n < NR
        o_ptrs = OUT + offs_t.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
        o_mask = rows[:, None] & in_n[None, :]
        if s < 0:
            tl.store(o_ptrs, tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32), mask=o_mask)
        else:
            offs_k = tl.arange(0, BLOCK_K)
            x_ptrs = X + offs_t.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
            a_ptrs = A + s.to(tl.int64) * stride_as + offs_n.to(tl.int64)[:, None] * stride_an + offs_k[None, :]
            acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if EVEN_K:
                    x = tl.load(x_ptrs, mask=rows[:, None], other=0.0)
                    a = tl.load(a_ptrs, mask=in_n[:, None], other=0.0)
                else:
                    k_ok = (k0 + offs_k) < K
                    x = tl.load(x_ptrs, mask=rows[:, None] & k_ok[None, :], other=0.0)
                    a = tl.load(a_ptrs, mask=in_n[:, None] & k_ok[None, :], other=0.0)
                if UPCAST:
                    x = x.to(tl.float32)
                    a = a.to(tl.float32)
                acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
                x_ptrs += BLOCK_K
                a_ptrs += BLOCK_K
            tl.store(o_ptrs, acc, mask=o_mask)


@triton.jit
def _bound(i: tl.constexpr, O1, O2, O3, OUT, N: tl.constexpr):
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
                        PRECISION: tl.constexpr, PDL: tl.constexpr):
    """OUT_PTR `[T, OUT]` = Y + the LoRA delta of each row's slot; SIN `[T, N*R]` fp32, B
    `[S, OUT, R]`, SCALE `[S, N]` fp32; slice i is columns [bound(i), bound(i + 1))."""
    pdl_wait(PDL)
    pid_t = tl.program_id(0)
    pid_o = tl.program_id(1)
    s, offs_t, rows = _slot_rows(SLOT, pid_t, T, S, BLOCK_T)
    if tl.sum(rows.to(tl.int32), axis=0) > 0:
        offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
        in_o = offs_o < OUT
        mask = rows[:, None] & in_o[None, :]
        t64 = offs_t.to(tl.int64)
        y = tl.load(Y + t64[:, None] * stride_yt + offs_o[None, :], mask=mask, other=0.0)
        if s < 0:
            out = y
        else:
            acc = y.to(tl.float32)
            offs_r = tl.arange(0, BLOCK_R)
            in_r = offs_r < R
            block_lo = pid_o * BLOCK_O
            for i in tl.static_range(N):
                lo = _bound(i, O1, O2, O3, OUT, N)
                hi = _bound(i + 1, O1, O2, O3, OUT, N)
                if (lo < block_lo + BLOCK_O) & (hi > block_lo):
                    sr = tl.load(SIN + t64[:, None] * stride_st + (i * R + offs_r)[None, :],
                                 mask=rows[:, None] & in_r[None, :], other=0.0)
                    sr = sr * tl.load(SCALE + s * stride_ss + i)
                    cols = in_o & (offs_o >= lo) & (offs_o < hi)
                    b = tl.load(B + s.to(tl.int64) * stride_bs + offs_o.to(tl.int64)[None, :] * stride_bo
                                + offs_r[:, None], mask=in_r[:, None] & cols[None, :], other=0.0)
                    acc = tl.dot(sr, b.to(tl.float32), acc, input_precision=PRECISION)
            out = acc.to(y.dtype)
        tl.store(OUT_PTR + t64[:, None] * stride_ot + offs_o[None, :], out, mask=mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slot: torch.Tensor,
                       config: LoRAConfig | None = None) -> torch.Tensor:
    """x `[T, in]`, a `[S, N*R, in]`, slot `[T]` -> `[T, N*R]` fp32 (shapes checked by the op)."""
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
    upcast = interpreter_upcast(x.dtype)
    precision = "ieee" if upcast or x.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(T, cfg.block_t), triton.cdiv(NR, cfg.block_n), S + 1)
    _lora_shrink_kernel[grid](
        x, a, out, slot, T, NR, K, S, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0,
        UPCAST=upcast, PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_kwargs(x.device))
    return out


def lora_expand_triton(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slot: torch.Tensor,
                       slices: list[int], config: LoRAConfig | None = None) -> torch.Tensor:
    """y `[T, out]`, s `[T, N*R]` fp32, b `[S, out, R]`, scale `[S, N]` fp32, slot `[T]` ->
    y + delta, a new `[T, out]` tensor in y's dtype (shapes checked by the op)."""
    T, OUT = y.shape
    S, _, R = b.shape
    N = len(slices)
    if N > MAX_SLICES:
        raise ValueError(f"lora_expand: {N} slices, the kernel takes at most {MAX_SLICES}")
    out = torch.empty((T, OUT), dtype=y.dtype, device=y.device)
    if T == 0 or OUT == 0:
        return out
    if R == 0 or S == 0:
        return out.copy_(y)
    y, s, b, scale = (_last_dim_contiguous(t) for t in (y, s, b, scale))
    cfg = config or expand_config(T, OUT)
    _check_config(cfg)
    bounds = [sum(slices[:i]) for i in range(1, MAX_SLICES)]
    fp32 = y.dtype == torch.float32 or b.dtype == torch.float32 or interpreting()
    grid = (triton.cdiv(T, cfg.block_t), triton.cdiv(OUT, cfg.block_n), S + 1)
    _lora_expand_kernel[grid](
        y, s, b, scale, slot, out, T, OUT, R, S, *bounds,
        y.stride(0), s.stride(0), b.stride(0), b.stride(1), scale.stride(0), out.stride(0),
        N=N, BLOCK_T=cfg.block_t, BLOCK_O=cfg.block_n, BLOCK_R=_pow2(R, MIN_BLOCK, 1 << 30),
        PRECISION="ieee" if fp32 else "tf32", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_kwargs(y.device))
    return out
