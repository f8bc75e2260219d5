"""The LoRA shrinks of the fused MoE with expert LoRA (`expert_lora.py`); the expands run inside
the base grouped GEMMs (`fused_moe_kernels`, LORA=True: `_pair_delta` in their epilogues), but
over W8A8 experts at decode sizes (`moe_lora_expand_kernel`: the gate and up deltas before the up
GEMM, the down deltas beside the down GEMM, summed a token for the top-k sum to add).

The pairs are sorted by expert into BLOCK_M blocks as for the base MoE (`moe_align_block_size`),
and the block-wise kernels keep every per-pair buffer in block order (row = the pair's position),
as the intermediate is. A block's rows share an expert but not a slot (each token has its own
adapter).

`moe_lora_shrink_kernel`, grid (blocks, S x SPLIT_K): program (b, s) computes, for the rows of
block b whose token's slot is s, `a[s, e] @ row` (fp32, one tensor-core dot a K step, the other
rows masked) into `s_out` at the rows' positions: x's token rows (GATHER: gate/up,
`a13 [S, E, 2R, H]`) or the intermediate's block rows (down, `a2 [S, E, R, I]`). Programs whose
slot is absent from their block exit after the slot loads; rows without an adapter (slot -1, or outside [0, S)) are not
written and never read. A decode batch has few (block, slot) programs, each a long walk over K
for its few rows: there the K range is split (`expert_lora.shrink_split`).

`moe_lora_pair_shrink_kernel`, grid (pairs, SPLIT_K): the gate/up shrink of a decode batch, one
pair (t, e) a program, `a13[slot[t], e] @ x[t]` in fp32 FMAs (one row: no tensor-core tile) into
row t * top_k + k of its output. It reads only the routing, so it runs beside the alignment
(`expert_lora.PAIR_SHRINK_MAX_PAIRS`); pairs that share an expert and a slot read its A each.
Pairs without an adapter are not written and never read. With BY_POSITION it is the down shrink
of a decode batch, a program a row of the intermediate (most of them padding rows, which return
at once), where a (block, slot) program's 16-row tile held about one live row; STORE_BY_PAIR
stores its rows in pair order, for the expand beside the down GEMM."""

from __future__ import annotations

import triton
import triton.language as tl

from compiled.moe.fused_moe_kernels import pair_slots
from compiled.triton_utils import masked_dot_t, pdl_wait, split_k_store


@triton.jit(do_not_specialize=["num_valid"])
def moe_lora_shrink_kernel(X, A, OUT, SLOT, sorted_ptr, expert_ids_ptr, num_post_ptr, num_valid, S, NR, K,
                           stride_xm, stride_as, stride_ae, stride_an, stride_om, Partials, Semaphores, ROWS,
                           K_PER_SPLIT, TOP_K: tl.constexpr, GATHER: tl.constexpr, PRECISION: tl.constexpr,
                           DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    """OUT[pos, n] = sum_k row[k] * A[s, e, n, k] (fp32, n < NR) for block pid_m's rows of slot
    s = program_id(1) // SPLIT_K; row = X[token] (GATHER) or X[pos] (the intermediate, block
    order). SPLIT_K > 1: program_id(1) % SPLIT_K takes one K range of K_PER_SPLIT (whole BLOCK_K
    steps with EVEN_K); the splits write fp32 partials `[SPLIT_K, ROWS, NR]` and bump the
    (block, slot) semaphore, and the last to arrive sums them in split order and stores the rows
    (`triton_utils.split_k_store`, as the linear's LoRA shrink does)."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    s = tl.program_id(1) // SPLIT_K
    pid_k = tl.program_id(1) % SPLIT_K
    offs_m = tl.arange(0, BLOCK_M)
    num_post = tl.load(num_post_ptr)
    if pid_m * BLOCK_M < num_post:
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_m)
        row_ok, token, slots = pair_slots(SLOT, pair, num_valid, S, TOP_K)
        rows = slots == s
        if tl.sum(rows.to(tl.int32), axis=0) > 0:
            expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
            pos = (pid_m * BLOCK_M + offs_m).to(tl.int64)
            offs_n = tl.arange(0, BLOCK_N)
            n_ok = offs_n < NR
            k_start = pid_k * K_PER_SPLIT
            k_end = tl.minimum(k_start + K_PER_SPLIT, K)
            offs_k = k_start + tl.arange(0, BLOCK_K)
            if GATHER:
                x_ptrs = X + token[:, None] * stride_xm + offs_k[None, :]
            else:
                x_ptrs = X + pos[:, None] * stride_xm + offs_k[None, :]
            a_ptrs = A + s.to(tl.int64) * stride_as + expert * stride_ae + offs_n[:, None] * stride_an + offs_k[None, :]
            acc = masked_dot_t(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), x_ptrs, a_ptrs, rows, n_ok, k_start,
                               k_end, BLOCK_K, EVEN_K, DOT_FP32, PRECISION)
            o_ptrs = OUT + pos[:, None] * stride_om + offs_n[None, :]
            o_mask = rows[:, None] & n_ok[None, :]
            split_k_store(acc, o_ptrs, Partials + pos[:, None] * NR + offs_n[None, :], ROWS * NR, o_mask,
                          Semaphores + pid_m * S + s, pid_k, SPLIT_K)


@triton.jit(do_not_specialize=["num_pairs"])
def moe_lora_pair_shrink_kernel(X, A, OUT, IDS, SLOT, num_pairs, S, NR, K, stride_xm, stride_as, stride_ae,
                                stride_an, stride_om, Partials, Semaphores, K_PER_SPLIT, expert_ids_ptr, num_post_ptr,
                                SCALE, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                SPLIT_K: tl.constexpr, BY_POSITION: tl.constexpr, BLOCK_M: tl.constexpr,
                                SCALE_COL: tl.constexpr, STORE_BY_PAIR: tl.constexpr, PDL: tl.constexpr):
    """OUT[p, n] = sum_k X[p // TOP_K, k] * A[s, IDS[p], n, k] (fp32, n < NR) for pair p =
    program_id(0), s its token's slot. BY_POSITION (the down shrink): program p is a row of the
    sorted order instead, IDS the sorted pair indices (`moe_align_block_size`; rows past its
    total and padding rows do nothing), its expert that of block p // BLOCK_M and its input
    X[p] (the intermediate, block order). SPLIT_K > 1: program_id(1) takes one K range of
    K_PER_SPLIT, writes fp32 partials `[SPLIT_K, programs, NR]` and bumps the program's semaphore;
    the last to arrive sums them in split order and stores the row (`triton_utils.split_k_store`).
    SCALE_COL >= 0: the row times its slot's SCALE[s, SCALE_COL] (`[S, 3]`), stored in OUT's dtype.
    STORE_BY_PAIR (with BY_POSITION): the row stored at its pair's index, not its position."""
    pdl_wait(PDL)
    p = tl.program_id(0)
    pid_k = tl.program_id(1)
    if BY_POSITION:
        pair = tl.load(IDS + p, mask=p < tl.load(num_post_ptr), other=num_pairs)
        x_row = p.to(tl.int64)
    else:
        pair = p
    live = pair < num_pairs
    token = tl.where(live, pair // TOP_K, 0).to(tl.int64)
    if not BY_POSITION:
        x_row = token
    s = tl.load(SLOT + token, mask=live, other=-1)
    if not BY_POSITION:   # a pair of id < 0 (another rank's expert) is never placed: no row to shrink
        s = tl.where(tl.load(IDS + p, mask=live, other=0) >= 0, s, -1)
    if live & (s >= 0) & (s < S):
        if BY_POSITION:
            expert = tl.load(expert_ids_ptr + p // BLOCK_M).to(tl.int64)
        else:
            expert = tl.load(IDS + p).to(tl.int64)
        offs_n = tl.arange(0, BLOCK_N)
        n_ok = offs_n < NR
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        a_rows = A + s.to(tl.int64) * stride_as + expert * stride_ae + offs_n[:, None] * stride_an
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_end
            x = tl.load(X + x_row * stride_xm + ks, mask=k_ok, other=0.0)
            a = tl.load(a_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
        out = tl.sum(acc, axis=1)
        if SCALE_COL >= 0:
            out = out * tl.load(SCALE + s * 3 + SCALE_COL)
        rows = tl.num_programs(0)
        o_row = pair.to(tl.int64) if STORE_BY_PAIR else p.to(tl.int64)
        split_k_store(out, OUT + o_row * stride_om + offs_n,
                      Partials + p.to(tl.int64) * NR + offs_n, rows * NR, n_ok, Semaphores + p, pid_k, SPLIT_K)


@triton.jit
def moe_lora_expand_kernel(OUT, SH, B, SCALE, WEIGHTS, SLOT, IDS, S, R, N, HALF, stride_o, stride_sh,
                           stride_bs, stride_be, stride_bn, TOP_K: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_N: tl.constexpr, BY_TOKEN: tl.constexpr, SCALE_COL: tl.constexpr, PDL: tl.constexpr):
    """Expert-LoRA expands over the BLOCK_N columns of program_id(1), in fp32: a pair p's delta is
    scale[s, c] * B[s, e, n] @ SH[p, h*R:(h+1)*R], s its token's slot, e = IDS[p] its expert (no
    delta where e < 0 or s is not in [0, S)), the columns n < HALF the first half (h = 0,
    c = SCALE_COL), the rest the second (h = 1, c = SCALE_COL + 1); a program's columns lie in
    one half. SH holds the shrink outputs by pair (`[T*k, .]`).

    By pair (the gate and up deltas, HALF = I): program_id(0) is a pair p and OUT[p] `[2I]` its
    delta, zeros without one, for the up GEMM to add as it stands. BY_TOKEN (the down delta,
    HALF = N = H): program_id(0) is a token t and OUT[t] `[H]` the sum over its TOP_K pairs of
    their deltas times their routing weights (WEIGHTS `[T*k]`), zeros without any, for the top-k
    sum's kernel to add."""
    pdl_wait(PDL)
    p = tl.program_id(0)
    first_blocks = tl.cdiv(HALF, BLOCK_N)
    half = (tl.program_id(1) >= first_blocks).to(tl.int32)
    offs_n = tl.where(half == 0, tl.program_id(1) * BLOCK_N, HALF + (tl.program_id(1) - first_blocks) * BLOCK_N) \
        + tl.arange(0, BLOCK_N)
    n_ok = offs_n < tl.where(half == 0, HALF, N)
    if BY_TOKEN:
        token = p.to(tl.int64)
        s = tl.load(SLOT + token)
        delta = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pair = token * TOP_K + j
            expert = tl.load(IDS + pair).to(tl.int64)
            has = (expert >= 0) & (s >= 0) & (s < S)
            delta += _expand_row(SH + pair * stride_sh, B, SCALE, s, tl.maximum(expert, 0), half,
                                 tl.load(WEIGHTS + pair), offs_n, n_ok, has, R, stride_bs, stride_be, stride_bn,
                                 BLOCK_R, SCALE_COL)
        tl.store(OUT + token * stride_o + offs_n, delta, mask=n_ok)
    else:
        token = (p // TOP_K).to(tl.int64)
        expert = tl.load(IDS + p).to(tl.int64)
        s = tl.load(SLOT + token)
        has = (expert >= 0) & (s >= 0) & (s < S)   # without: the loads masked off, zeros stored
        delta = _expand_row(SH + p.to(tl.int64) * stride_sh, B, SCALE, s, tl.maximum(expert, 0), half, 1.0,
                            offs_n, n_ok, has, R, stride_bs, stride_be, stride_bn, BLOCK_R, SCALE_COL)
        tl.store(OUT + p.to(tl.int64) * stride_o + offs_n, delta, mask=n_ok)


@triton.jit
def _expand_row(sh_row, B, SCALE, s, expert, half, weight, offs_n, n_ok, has, R, stride_bs, stride_be, stride_bn,
                BLOCK_R: tl.constexpr, SCALE_COL: tl.constexpr):
    """`moe_lora_expand_kernel`'s delta `[BLOCK_N]` fp32 for slot s of `expert` (`has`: s in
    [0, S) and the pair has a delta; loads masked off otherwise, zeros returned)."""
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = (offs_r < R) & (offs_r * 0 + has.to(tl.int32) > 0)   # a vector: the interpreter takes no scalar bool
    factor = tl.load(SCALE + tl.where(has, s * 3 + SCALE_COL + half, 0)) * weight   # finite where masked
    shrunk = tl.load(sh_row + half * R + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    b = tl.load(B + s.to(tl.int64) * stride_bs + expert * stride_be + offs_n[:, None] * stride_bn + offs_r[None, :],
                mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    return tl.sum(b.to(tl.float32) * (shrunk * factor)[None, :], axis=1)
