"""Triton kernels for the fused MoE: block alignment, two grouped GEMMs and the top-k sum.

Design (after SGLang/vLLM's fused_moe, written from scratch):

* `align_count_kernel` / `align_place_kernel` sort the T*k (token, slot) pairs by expert into a
  buffer whose per-expert segments are padded to BLOCK_M, write the expert of every BLOCK_M block
  and the padded total. Everything is sized by a fixed upper bound, so nothing syncs with the host
  and the whole thing can be captured in a CUDA graph. A chunk's offset inside each expert segment
  comes from an atomic add (so chunks land in arrival order), ranks inside a chunk from a one-hot
  prefix sum. The order of rows inside a segment does not change any result: every GEMM row is
  computed on its own and the top-k sum runs in slot order. A pair of id < 0 (expert parallelism:
  another rank's expert) matches no expert, so it is never placed and no GEMM computes it.
  With ROUTE the count kernel's programs route the tokens of their chunk first
  (`routing_kernels.route_rows`, what the routing op's kernel runs), so that the routing takes no
  launch of its own.
* `moe_gemm1_kernel`: one program per (block, N tile); gathers the block's token rows of x, multiplies
  by the gate and the up tile of its expert's `w13` and writes `silu(gate) * up` (fused epilogue)
  in block order, so that each block's rows are one contiguous tile for the next GEMM.
* `moe_gemm2_kernel`: same grid over `w2`, reading those tiles (through TMA on Hopper); the epilogue
  multiplies by the routing weight.
* `moe_sum_kernel`: the sum of every token's k weighted expert outputs, in fp32 and slot order,
  leaving out the pairs of id < 0 (`moe_sum_add_rms_norm_kernel`: with the residual add + RMSNorm
  of the layer after it).

Blocks past the padded total (and so experts without tokens) exit at once. DOT_FP32 upcasts the
operands of `tl.dot` (exact products, fp32 sums): only for the CPU interpreter, whose bf16 dot is
wrong in triton 3.9."""

from __future__ import annotations

import triton
import triton.language as tl

from compiled.moe.routing_kernels import route_rows
from compiled.quant.act_quant import quantize_row, quantize_tile, quantized_groups
from compiled.triton_utils import (add_rms_norm_row, add_rms_norm_values, col_scaled, one_slot_dot, one_slot_operands,
                                   pdl_wait, row_shrink, scaled_tile, slot_bits, slot_stacked_delta, col_scales,
                                   w8a8_rows, w8a8_scales, w8a8_step, w8a8_step_t)


@triton.jit
def route_span(RL, RW, ids_ptr, lo, hi, E, stride_rl, first, count, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
               E_PAD: tl.constexpr, RENORM: tl.constexpr, LOCAL: tl.constexpr, R_ROWS: tl.constexpr):
    """Route tokens [lo, hi) (`route_rows`, R_ROWS at a time), then sync the program's threads so
    that each reads back the ids the others stored."""
    for r0 in range(lo, hi, R_ROWS):
        route_rows(RL, RW, ids_ptr, r0, hi, E, stride_rl, first, count, TOP_K, K_PAD, E_PAD, R_ROWS, RENORM, LOCAL)
    tl.debug_barrier()


@triton.jit
def align_count_kernel(ids_ptr, totals_ptr, bases_ptr, numel, RL, RW, T, E, stride_rl, first, count,
                       CHUNK: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr, ROUTE: tl.constexpr,
                       TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr, LOCAL: tl.constexpr,
                       R_ROWS: tl.constexpr, PDL: tl.constexpr):
    """Count this CHUNK's pairs per expert, add them to totals[e] (zeroed before the launch) and
    keep the old totals as this chunk's base: the pairs of the chunks that got there first. ROUTE:
    the chunk's tokens (CHUNK / TOP_K of them) routed first from the logits RL `[T, E]`."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    if ROUTE:
        lo = pid * (CHUNK // TOP_K)
        route_span(RL, RW, ids_ptr, lo, tl.minimum(lo + CHUNK // TOP_K, T), E, stride_rl, first, count, TOP_K, K_PAD,
                   E_PAD, RENORM, LOCAL, R_ROWS)
    experts = tl.arange(0, E_PAD)
    cnt = tl.zeros([E_PAD], dtype=tl.int32)
    for s in range(0, CHUNK, SUB):
        offs = pid * CHUNK + s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=E_PAD).to(tl.int32)
        cnt += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    base = tl.atomic_add(totals_ptr + experts, cnt)
    tl.store(bases_ptr + pid * E_PAD + experts, base)


@triton.jit
def align_place_kernel(ids_ptr, totals_ptr, bases_ptr, done_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                       numel, max_blocks, n_chunks, X, XQ, XS, T, K, stride_x, stride_xq, stride_xs, stride_xsg,
                       GROUP, q_gprog,
                       BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                       E_PAD: tl.constexpr, BB: tl.constexpr, COUNT_ALL: tl.constexpr, RESET: tl.constexpr,
                       QUANT: tl.constexpr, Q_ROWS: tl.constexpr, Q_GROUPS: tl.constexpr, Q_BLOCK_G: tl.constexpr,
                       PDL: tl.constexpr):
    """Scatter this chunk's pair indices to their padded slots; write block experts and padding.
    Programs 0..n_chunks-1 align; with QUANT, the programs after them quantize x `[T, K]` for
    the W8A8 up GEMM (`quant.act_quant.quantize_tile`: Q_ROWS rows by Q_GROUPS groups of GROUP
    each, q_gprog programs along a row) into XQ and XS, which saves that launch.

    COUNT_ALL (> 0: a bound on the pairs, a multiple of SUB): every program counts all the pairs
    itself, and those of the chunks before its own, so no count kernel runs before it. RESET: the
    program that finishes last (a counter at done_ptr) puts the totals and the counter back to
    zero for the next call, so no memset launch precedes the count kernel."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    if QUANT:
        if pid >= n_chunks:
            q = pid - n_chunks
            quantize_tile(X, XQ, XS, (q // q_gprog) * Q_ROWS, T, (q % q_gprog) * Q_GROUPS, K, stride_x, stride_xq,
                          stride_xs, stride_xsg, GROUP, Q_ROWS, Q_GROUPS, Q_BLOCK_G)
            return
    experts = tl.arange(0, E_PAD)
    if COUNT_ALL:
        total_cnt = tl.zeros([E_PAD], dtype=tl.int32)
        base = tl.zeros([E_PAD], dtype=tl.int32)
        for s in range(0, COUNT_ALL, SUB):
            offs = s + tl.arange(0, SUB)
            ids = tl.load(ids_ptr + offs, mask=offs < numel, other=E_PAD).to(tl.int32)
            hits = (ids[:, None] == experts[None, :]).to(tl.int32)
            total_cnt += tl.sum(hits, axis=0)
            base += tl.sum(hits * (offs < pid * CHUNK).to(tl.int32)[:, None], axis=0)
    else:
        total_cnt = tl.load(totals_ptr + experts)
        base = tl.load(bases_ptr + pid * E_PAD + experts)
    padded = (total_cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    if pid == 0:
        tl.store(num_post_ptr, total)

    # 1. valid slots: expert start + pairs of this expert in earlier chunks + rank inside the chunk
    cursor = starts + base
    for s in range(0, CHUNK, SUB):
        offs = pid * CHUNK + s + tl.arange(0, SUB)
        m = offs < numel
        ids = tl.load(ids_ptr + offs, mask=m, other=E_PAD).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        incl = tl.cumsum(onehot, axis=0)
        slot = tl.sum(onehot * (incl - 1 + cursor[None, :]), axis=1)
        tl.store(sorted_ptr + slot, offs, mask=m & (ids >= 0))   # id < 0: no slot (its sum is 0)
        cursor += tl.sum(onehot, axis=0)

    # 2. blocks: expert of each block (-1 past the total) and the padding sentinels (numel);
    #    positions disjoint from the slots above, so no ordering between programs is needed
    n_prog = n_chunks
    rows = tl.arange(0, BLOCK_M)
    for b0 in range(pid * BB, max_blocks, n_prog * BB):
        b = b0 + tl.arange(0, BB)
        start = b * BLOCK_M
        live = start < total
        ex = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b, tl.where(live, ex, -1), mask=b < max_blocks)
        sel = (ex[:, None] == experts[None, :]).to(tl.int32)
        seg_start = tl.sum(sel * starts[None, :], axis=1)
        seg_cnt = tl.sum(sel * total_cnt[None, :], axis=1)
        pos = start[:, None] + rows[None, :]
        pad = (pos - seg_start[:, None]) >= seg_cnt[:, None]
        tl.store(sorted_ptr + pos, tl.zeros([BB, BLOCK_M], dtype=tl.int32) + numel,
                 mask=pad & live[:, None])
    if RESET:
        # every program read the totals at its start, before it arrives here
        tl.debug_barrier()
        arrived = tl.atomic_add(done_ptr, 1, sem="acq_rel")
        if arrived == n_prog - 1:
            tl.store(totals_ptr + experts, tl.zeros([E_PAD], dtype=tl.int32))
            tl.store(done_ptr, 0)


@triton.jit
def _tile_ids(N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n): tile ids, grouped along M so that blocks sharing weight tiles run together."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.num_programs(0) // num_pid_n
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_m, (pid % in_group) // group_m


@triton.jit
def _block(N, num_valid, sorted_ptr, num_post_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           GROUP_M: tl.constexpr):
    """(pid_m, pid_n, pair indices of the block's rows (num_valid marks padding), block is live)."""
    pid_m, pid_n = _tile_ids(N, BLOCK_N, GROUP_M)
    offs_m = tl.arange(0, BLOCK_M)
    num_post = tl.load(num_post_ptr)
    live = pid_m * BLOCK_M < num_post
    # (a vector mask built without broadcasting a scalar bool: the interpreter rejects those)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_m, mask=(offs_m * 0 + pid_m * BLOCK_M) < num_post,
                   other=num_valid)
    return pid_m, pid_n, pair, live


@triton.jit
def pair_slots(SLOT, pair, num_valid, S, TOP_K: tl.constexpr):
    """(row is a real pair, its token, its slot: -1 for padding rows and slots outside [0, S))."""
    row_ok = pair < num_valid
    token = tl.where(row_ok, pair // TOP_K, 0).to(tl.int64)
    slots = tl.load(SLOT + token, mask=row_ok, other=-1).to(tl.int32)
    slots = tl.where(row_ok & (slots >= 0) & (slots < S), slots, -1)
    return row_ok, token, slots


@triton.jit
def _pair_delta(acc, pair, pos, expert, cols, cols_ok, col0, scale_col, num_valid,
                L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                TOP_K: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_R: tl.constexpr, KC: tl.constexpr,
                DELTA_PRECISION: tl.constexpr, DELTA_16BIT: tl.constexpr):
    """acc + each row's expert-LoRA expand (`expert_lora.py`): scale[s, scale_col] *
    L_S[pos, col0:col0+R] @ L_B[s, expert, cols, :R].T with s the slot of the row's token (rows
    without an adapter, padding rows and slots outside [0, L_NS) get none; a tile without any
    skips it)."""
    _, _, slots = pair_slots(L_SLOT, pair, num_valid, L_NS, TOP_K)
    return _slots_delta(acc, slots, pos, expert, cols, cols_ok, col0, scale_col, L_S, L_B, L_SCALE, L_R, stride_ls,
                        stride_lbs, stride_lbe, stride_lbn, SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT)


@triton.jit
def _slots_delta(acc, slots, pos, expert, cols, cols_ok, col0, scale_col, L_S, L_B, L_SCALE, L_R, stride_ls, stride_lbs,
                 stride_lbe, stride_lbn, SLOTS_PAD: tl.constexpr, BLOCK_R: tl.constexpr, KC: tl.constexpr,
                 DELTA_PRECISION: tl.constexpr, DELTA_16BIT: tl.constexpr):
    """`_pair_delta` for rows whose slots are known."""
    if tl.sum((slots >= 0).to(tl.int32), axis=0) > 0:
        acc = slot_stacked_delta(acc, L_S, L_B, L_SCALE, slots, pos, cols, cols_ok, expert, col0, L_R, stride_ls,
                                 stride_lbs, stride_lbe, stride_lbn, 3, scale_col, SLOTS_PAD, BLOCK_R, KC,
                                 DELTA_PRECISION, DELTA_16BIT)
    return acc


@triton.jit
def _pair_operands(slots, pos, expert, cols, cols_ok, col0, scale_col, L_S, L_B, L_SCALE, L_R, stride_ls, stride_lbs,
                   stride_lbe, stride_lbn, SLOTS_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """`_pair_delta`'s one-slot loads, made before the K loop (`triton_utils.one_slot_operands`)."""
    return one_slot_operands(L_S, L_B, L_SCALE, slots, pos, cols, cols_ok, expert, col0, L_R, stride_ls, stride_lbs,
                             stride_lbe, stride_lbn, 3, scale_col, SLOTS_PAD, BLOCK_R)


@triton.jit
def _pair_delta_loaded(acc, slots, one, sr, sc, b, pos, expert, cols, cols_ok, col0, scale_col, L_S, L_B, L_SCALE,
                       L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn, SLOTS_PAD: tl.constexpr,
                       BLOCK_R: tl.constexpr, KC: tl.constexpr, DELTA_PRECISION: tl.constexpr,
                       DELTA_16BIT: tl.constexpr):
    """`_pair_delta` after the K loop, from the one-slot operands loaded before it; a tile of
    several slots loads the stacked operands now."""
    if one:
        acc = one_slot_dot(acc, sr, sc, b, DELTA_PRECISION, DELTA_16BIT)
    else:
        acc = _slots_delta(acc, slots, pos, expert, cols, cols_ok, col0, scale_col, L_S, L_B, L_SCALE, L_R, stride_ls,
                           stride_lbs, stride_lbe, stride_lbn, SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT)
    return acc


@triton.jit
def _gate_up_deltas(acc_g, acc_u, pair, pos, expert, offs_n, N, num_valid, L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R,
                    stride_ls, stride_lbs, stride_lbe, stride_lbn, TOP_K: tl.constexpr, SLOTS_PAD: tl.constexpr,
                    BLOCK_R: tl.constexpr, KC: tl.constexpr, DELTA_PRECISION: tl.constexpr,
                    DELTA_16BIT: tl.constexpr):
    """The gate and up tiles' deltas (`_pair_delta`): gate's shrink outputs are columns 0..R of
    L_S and its B rows 0..N, up's R..2R and N..2N."""
    n_ok = offs_n < N
    acc_g = _pair_delta(acc_g, pair, pos, expert, offs_n, n_ok, 0, 0, num_valid,
                        L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                        TOP_K, SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT)
    acc_u = _pair_delta(acc_u, pair, pos, expert, offs_n + N, n_ok, L_R, 1, num_valid,
                        L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                        TOP_K, SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT)
    return acc_g, acc_u


@triton.jit
def _store_quantized(out, IQ, IS, rows, row_ok, offs_n, pid_n, N, stride_iq, stride_is, TILE_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """The intermediate tile `out` (16-bit, rows `rows`) as a W8A8 down GEMM reads it: each row's
    GROUP-wide groups (BLOCK_N a multiple of GROUP, so the tile holds whole groups) quantized into
    IQ with their scales in IS, the bits `quant.act_quant` gives for the stored 16-bit rows."""
    GROUPS: tl.constexpr = BLOCK_N // GROUP
    mask = row_ok[:, None] & (offs_n < N)[None, :]
    v = tl.where(mask, out.to(tl.float32), 0.0)
    q, s = quantized_groups(tl.reshape(v, (TILE_M, GROUPS, GROUP)), 2)
    r = rows.to(tl.int64)[:, None]
    tl.store(IQ + r * stride_iq + offs_n[None, :], tl.reshape(q, (TILE_M, BLOCK_N)).to(IQ.dtype.element_ty), mask=mask)
    g = pid_n * GROUPS + tl.arange(0, GROUPS)
    tl.store(IS + r * stride_is + g[None, :], s, mask=row_ok[:, None] & (g * GROUP < N)[None, :])


@triton.jit
def _up_tile(x_ptr, w_ptr, w_desc, out_ptr, pair, pos, expert, pid_n, num_valid, N, K,
             stride_xm, stride_we, stride_wn, stride_om,
             TOP_K: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
             TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
             TMA: tl.constexpr, L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
             LORA: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_R: tl.constexpr, KC: tl.constexpr,
             DELTA_PRECISION: tl.constexpr, DELTA_16BIT: tl.constexpr, DELTA_FIRST: tl.constexpr,
             PAIR_ROWS: tl.constexpr, S, stride_se, stride_sn, BO, BI, AS, stride_as, FP8: tl.constexpr,
             IQ, IS, stride_iq, stride_is, OUT_GROUP: tl.constexpr, SWAP: tl.constexpr):
    """silu(gate) * up for the TILE_M rows `pair` (a power of two >= 16) and one N tile. TMA: the
    weight tiles come through `w_desc` (w as `[E * 2N, K]`, block `[BLOCK_N, BLOCK_K]`); rows past
    the tile's N read the neighbouring rows (or zeros past the end), whose columns are not stored.
    LORA: the gate and up deltas (`_pair_delta`, shrink outputs `[rows, 2R]`) added before silu,
    a tile of one slot's operands loaded before the K loop (in flight during it); DELTA_FIRST:
    the deltas as the accumulators' start, before the K loop. PAIR_ROWS: the shrink outputs' rows
    are the positions (0, block order) or the pairs (1, `moe_lora_pair_shrink_kernel`), or (2) L_S
    holds each pair's gate and up deltas themselves (`[T*k, 2N]` fp32, `moe_lora_expand_kernel`),
    loaded before the K loop and added after it. OUT_GROUP:
    the tile stored quantized (`_store_quantized`), and with LORA into out as well. SWAP (W8A8
    only: the launch sets it with the activations' scales): each step's dot as weight tile x rows
    (`triton_utils.w8a8_step_t`), summed transposed; a few tokens an expert then still fill
    Hopper's 64-row warpgroup MMA instead of 16-row MMAs reading the weight tile through registers."""
    row_ok = pair < num_valid
    if PAIR_ROWS >= 1:
        s_rows = tl.where(row_ok, pair, 0)
    else:
        s_rows = pos
    token = tl.where(row_ok, pair // TOP_K, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_nw = (offs_n % N).to(tl.int64)
    a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_nw[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    row_g = (expert * 2 * N + pid_n * BLOCK_N).to(tl.int32)
    acc_g = tl.zeros([TILE_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([TILE_M, BLOCK_N], dtype=tl.float32)
    if LORA and PAIR_ROWS == 2:   # in flight during the K loop
        d_ptrs = L_S + s_rows.to(tl.int64)[:, None] * stride_ls + offs_n[None, :]
        d_ok = row_ok[:, None] & (offs_n < N)[None, :]
        d_g = tl.load(d_ptrs, mask=d_ok, other=0.0)
        d_u = tl.load(d_ptrs + N, mask=d_ok, other=0.0)
    elif LORA and DELTA_FIRST:
        acc_g, acc_u = _gate_up_deltas(acc_g, acc_u, pair, s_rows, expert, offs_n, N, num_valid, L_S, L_B, L_SCALE,
                                       L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn, TOP_K,
                                       SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT)
    if LORA and not DELTA_FIRST and PAIR_ROWS < 2:   # the one-slot delta operands in flight during the K loop
        n_ok = offs_n < N
        _, _, slots = pair_slots(L_SLOT, pair, num_valid, L_NS, TOP_K)
        one, sr_g, sc_g, b_g = _pair_operands(slots, s_rows, expert, offs_n, n_ok, 0, 0, L_S, L_B, L_SCALE, L_R,
                                              stride_ls, stride_lbs, stride_lbe, stride_lbn, SLOTS_PAD, BLOCK_R)
        _, sr_u, sc_u, b_u = _pair_operands(slots, s_rows, expert, offs_n + N, n_ok, L_R, 1, L_S, L_B, L_SCALE, L_R,
                                            stride_ls, stride_lbs, stride_lbe, stride_lbn, SLOTS_PAD, BLOCK_R)
    n_k = tl.cdiv(K, BLOCK_K)
    if FP8 >= 3:   # W8A8: each step's scales loaded a step ahead (the loop's pipelining leaves them out)
        s_e, as_rows = S + expert * stride_se, AS + token * stride_as
        w_rows = w8a8_rows(offs_nw, pid_n, BLOCK_N, FP8 == 4)
        sa_n, sg_n = w8a8_scales(as_rows, s_e, w_rows, 0, stride_sn, BO, BI)
        su_n = col_scales(s_e, w_rows + N, 0, stride_sn, BO, BI)
    acc_gt = tl.zeros([BLOCK_N, TILE_M], dtype=tl.float32)
    acc_ut = tl.zeros([BLOCK_N, TILE_M], dtype=tl.float32)
    for k in range(0, n_k):
        if FP8 >= 3:
            sa, sg, su = sa_n, sg_n, su_n
            k_next = tl.minimum(k + 1, n_k - 1) * BLOCK_K
            sa_n, sg_n = w8a8_scales(as_rows, s_e, w_rows, k_next, stride_sn, BO, BI)
            su_n = col_scales(s_e, w_rows + N, k_next, stride_sn, BO, BI)
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(offs_k < K - k * BLOCK_K)[None, :], other=0.0)
        if TMA:
            g = w_desc.load([row_g, k * BLOCK_K]).T
            u = w_desc.load([row_g + N, k * BLOCK_K]).T
        elif EVEN_K:
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if FP8 == 2:
            g = col_scaled(g, S + expert * stride_se, offs_nw, k * BLOCK_K, stride_sn, BO, BI, a.dtype)
            u = col_scaled(u, S + expert * stride_se, offs_nw + N, k * BLOCK_K, stride_sn, BO, BI, a.dtype)
        elif FP8 == 1:
            kk = (k * BLOCK_K + offs_k)[:, None]
            g = scaled_tile(g, S + expert * stride_se, offs_nw[None, :], kk, kk < K, stride_sn, BO, BI, a.dtype, FP8)
            u = scaled_tile(u, S + expert * stride_se, (offs_nw + N)[None, :], kk, kk < K, stride_sn, BO, BI, a.dtype,
                            FP8)
        if DOT_FP32:
            a = a.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        if SWAP:
            acc_gt = w8a8_step_t(acc_gt, a, g, sa, sg, PRECISION, FP8 == 4)
            acc_ut = w8a8_step_t(acc_ut, a, u, sa, su, PRECISION, FP8 == 4)
        elif FP8 >= 3:
            acc_g = w8a8_step(acc_g, a, g, sa, sg, PRECISION, FP8 == 4)
            acc_u = w8a8_step(acc_u, a, u, sa, su, PRECISION, FP8 == 4)
        else:
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if SWAP:
        acc_g += tl.trans(acc_gt)
        acc_u += tl.trans(acc_ut)
    if LORA and PAIR_ROWS == 2:
        acc_g += d_g
        acc_u += d_u
    elif LORA and not DELTA_FIRST:
        acc_g = _pair_delta_loaded(acc_g, slots, one, sr_g, sc_g, b_g, s_rows, expert, offs_n, n_ok, 0, 0, L_S, L_B,
                                   L_SCALE, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn, SLOTS_PAD, BLOCK_R, KC,
                                   DELTA_PRECISION, DELTA_16BIT)
        acc_u = _pair_delta_loaded(acc_u, slots, one, sr_u, sc_u, b_u, s_rows, expert, offs_n + N, n_ok, L_R, 1, L_S,
                                   L_B, L_SCALE, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn, SLOTS_PAD,
                                   BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT)
    # round like the unfused model: gate/up in the activation dtype, silu, product
    dt = out_ptr.dtype.element_ty
    gate = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    out = (act * up).to(dt)
    if OUT_GROUP:
        _store_quantized(out, IQ, IS, pos, row_ok, offs_n, pid_n, N, stride_iq, stride_is, TILE_M, BLOCK_N, OUT_GROUP)
    if LORA or not OUT_GROUP:   # with LoRA the down GEMM's shrink reads the 16-bit rows
        o_ptrs = out_ptr + pos.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, out, mask=row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit
def _k_step_with_delta(a_rows, w_cols, k, n_k, K, slots, present, pos, expert, offs_k, offs_nw, n_ok, L_S, L_B, L_R,
                       stride_ls, stride_lbs, stride_lbe, stride_lbn, EVEN_K: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_K: tl.constexpr, R_FULL: tl.constexpr):
    """The (a, b) tiles of K step k of a GEMM whose LoRA delta runs as its last steps: steps below
    n_k read the base operands (a_rows / w_cols: the rows' and columns' first K element), the steps
    after them the slots stacked along K (column d = s * BLOCK_R + r, BLOCK_R dividing BLOCK_K):
    a = L_S[pos, r] where the row's slot is s (the shrink outputs, already scaled, in the operands'
    dtype), else 0, and b = L_B[s, expert, cols, r] for the slots present (bit s of `present`).
    So the loop's pipeline fetches the delta's operands while the base steps run, and the delta is
    summed into the same accumulator. The step's kind is one scalar and each slot's r runs
    contiguous, so the loads stay vectorized."""
    base = k < n_k
    slot_d = (k - n_k) * (BLOCK_K // BLOCK_R) + offs_k // BLOCK_R
    r_d = offs_k % BLOCK_R
    hit = slots[:, None] == slot_d[None, :]
    live = ((present >> slot_d) & 1) != 0
    if not R_FULL:   # a rank below the tile's: mask its padding (R_FULL: the loads stay unmasked along r)
        live = live & (r_d < L_R)
    kk = k * BLOCK_K + offs_k
    a_ptrs = tl.where(base, a_rows + kk[None, :], L_S + pos.to(tl.int64)[:, None] * stride_ls + r_d[None, :])
    b_ptrs = tl.where(base, w_cols + kk[:, None],
                      L_B + slot_d.to(tl.int64)[:, None] * stride_lbs + expert * stride_lbe
                      + offs_nw[None, :] * stride_lbn + r_d[:, None])
    if EVEN_K:
        a_base_ok = kk[None, :] >= 0
    else:
        a_base_ok = kk[None, :] < K
    a = tl.load(a_ptrs, mask=tl.where(base, a_base_ok, hit & live[None, :]), other=0.0)
    b = tl.load(b_ptrs, mask=tl.where(base, tl.trans(a_base_ok), live[:, None]) & n_ok[None, :], other=0.0)
    return a, b


@triton.jit
def _down_tile(a_ptr, a_desc, w_ptr, w_desc, out_ptr, weights_ptr, pair, first_pos, expert,
               pid_n, num_valid, N, K, stride_am, stride_we, stride_wn, stride_om,
               PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
               TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               TMA: tl.constexpr, A_TMA: tl.constexpr,
               L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn, TOP_K: tl.constexpr,
               LORA: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_R: tl.constexpr, KC: tl.constexpr,
               DELTA_PRECISION: tl.constexpr, DELTA_16BIT: tl.constexpr, DELTA_FIRST: tl.constexpr,
               DELTA_IN_K: tl.constexpr, R_FULL: tl.constexpr, S, stride_se, stride_sn, BO, BI, AS,
               stride_as, FP8: tl.constexpr, SWAP: tl.constexpr):
    """weight * (a . w2[e]) for the TILE_M rows `pair` and one N tile. TMA as in _up_tile
    (w as `[E * N, K]`). a holds the rows in block order: this tile's are the TILE_M from
    `first_pos` (padding rows hold anything; their outputs are not stored), through `a_desc`
    (block `[TILE_M, BLOCK_K]`) with A_TMA. LORA: the down delta (`_pair_delta`, shrink outputs
    `[rows, R]` in block order) added before the routing weight, its one-slot operands loaded
    before the K loop (DELTA_FIRST: the delta itself before the K loop); DELTA_IN_K (pointer loads
    only): the delta as the loop's last steps (`_k_step_with_delta`), its shrink outputs scaled
    and in a's dtype. FP8 (pointer loads, not with DELTA_IN_K): the weight tiles scaled by their
    blocks of S (`[E, N / BO, K / BI]`). SWAP as in _up_tile."""
    row_ok = pair < num_valid
    row = tl.where(row_ok, pair, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_nw = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + (first_pos + tl.arange(0, TILE_M)).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + offs_nw[None, :] * stride_wn + offs_k[:, None]
    row_b = (expert * N + pid_n * BLOCK_N).to(tl.int32)
    acc = tl.zeros([TILE_M, BLOCK_N], dtype=tl.float32)
    pos = first_pos + tl.arange(0, TILE_M)
    if LORA and DELTA_FIRST:
        acc = _pair_delta(acc, pair, pos, expert, offs_n, offs_n < N, 0, 2, num_valid,
                          L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                          TOP_K, SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT)
    if LORA and not DELTA_FIRST and not DELTA_IN_K:   # the one-slot delta operands in flight in the K loop
        _, _, slots = pair_slots(L_SLOT, pair, num_valid, L_NS, TOP_K)
        one, sr, sc, b_d = _pair_operands(slots, pos, expert, offs_n, offs_n < N, 0, 2, L_S, L_B, L_SCALE, L_R,
                                          stride_ls, stride_lbs, stride_lbe, stride_lbn, SLOTS_PAD, BLOCK_R)
    n_k = tl.cdiv(K, BLOCK_K)
    steps = n_k
    if LORA and DELTA_IN_K:
        _, _, slots = pair_slots(L_SLOT, pair, num_valid, L_NS, TOP_K)
        present = slot_bits(slots)
        if present != 0:
            steps = n_k + tl.cdiv(SLOTS_PAD * BLOCK_R, BLOCK_K)
        a_rows = a_ptr + (first_pos + tl.arange(0, TILE_M)).to(tl.int64)[:, None] * stride_am
        w_cols = w_ptr + expert * stride_we + offs_nw[None, :] * stride_wn
    if FP8 >= 3:   # as in _up_tile: each step's scales loaded a step ahead
        as_rows = AS + pos.to(tl.int64) * stride_as
        w_rows = w8a8_rows(offs_nw, pid_n, BLOCK_N, FP8 == 4)
        sa_n, sw_n = w8a8_scales(as_rows, S + expert * stride_se, w_rows, 0, stride_sn, BO, BI)
    acc_t = tl.zeros([BLOCK_N, TILE_M], dtype=tl.float32)
    for k in range(0, steps):
        if FP8 >= 3:
            sa, sw = sa_n, sw_n
            sa_n, sw_n = w8a8_scales(as_rows, S + expert * stride_se, w_rows, tl.minimum(k + 1, n_k - 1) * BLOCK_K,
                                     stride_sn, BO, BI)
        if LORA and DELTA_IN_K:
            a, b = _k_step_with_delta(a_rows, w_cols, k, n_k, K, slots, present, pos, expert, offs_k, offs_nw,
                                      offs_n < N, L_S, L_B, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn, EVEN_K,
                                      BLOCK_R, BLOCK_K, R_FULL)
        else:
            if A_TMA:
                a = a_desc.load([first_pos.to(tl.int32), k * BLOCK_K])
            elif EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=(offs_k < K - k * BLOCK_K)[None, :], other=0.0)
            if TMA:
                b = w_desc.load([row_b, k * BLOCK_K]).T
            elif EVEN_K:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=(offs_k < K - k * BLOCK_K)[:, None], other=0.0)
        if FP8 == 2:
            b = col_scaled(b, S + expert * stride_se, offs_nw, k * BLOCK_K, stride_sn, BO, BI, a.dtype)
        elif FP8 == 1:
            kk = (k * BLOCK_K + offs_k)[:, None]
            b = scaled_tile(b, S + expert * stride_se, offs_nw[None, :], kk, kk < K, stride_sn, BO, BI, a.dtype, FP8)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SWAP:
            acc_t = w8a8_step_t(acc_t, a, b, sa, sw, PRECISION, FP8 == 4)
        elif FP8 >= 3:
            acc = w8a8_step(acc, a, b, sa, sw, PRECISION, FP8 == 4)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SWAP:
        acc += tl.trans(acc_t)
    if LORA and not DELTA_FIRST and not DELTA_IN_K:
        acc = _pair_delta_loaded(acc, slots, one, sr, sc, b_d, pos, expert, offs_n, offs_n < N, 0, 2, L_S, L_B,
                                 L_SCALE, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn, SLOTS_PAD, BLOCK_R, KC,
                                 DELTA_PRECISION, DELTA_16BIT)
    dt = out_ptr.dtype.element_ty
    w = tl.load(weights_ptr + row, mask=row_ok, other=0.0).to(dt).to(tl.float32)
    out = (acc.to(dt).to(tl.float32) * w[:, None]).to(dt)
    o_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit
def _first_rows(sorted_ptr, pid_m, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr):
    """The pair indices of the first TILE_M rows of block pid_m (an expert's padding comes last)."""
    return tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, TILE_M))


@triton.jit
def _tile_rows(pair, num_valid, BLOCK_M: tl.constexpr, HALF_M: tl.constexpr):
    """Height of the tile a block runs: BLOCK_M, or with HALF_M >= 1 (>= 2) half (a quarter) of it
    when that many rows hold all the block's real pairs (an expert's partial last block)."""
    n_real = tl.sum((pair < num_valid).to(tl.int32), axis=0)
    height = BLOCK_M
    if HALF_M >= 1:
        height = tl.where(n_real <= BLOCK_M // 2, BLOCK_M // 2, height)
    if HALF_M >= 2:
        height = tl.where(n_real <= BLOCK_M // 4, BLOCK_M // 4, height)
    return height


@triton.jit(do_not_specialize=["num_valid"])
def moe_gemm1_kernel(x_ptr, w_ptr, w_desc, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                     num_valid, N, K, stride_xm, stride_we, stride_wn, stride_om,
                     TOP_K: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, HALF_M: tl.constexpr, TMA: tl.constexpr,
                     L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                     LORA: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_R: tl.constexpr, KC: tl.constexpr,
                     DELTA_PRECISION: tl.constexpr, DELTA_16BIT: tl.constexpr, DELTA_FIRST: tl.constexpr,
                     PAIR_ROWS: tl.constexpr, S, stride_se, stride_sn, BO, BI, AS, stride_as, FP8: tl.constexpr,
                     IQ, IS, stride_iq, stride_is, OUT_GROUP: tl.constexpr, PDL: tl.constexpr,
                     SWAP: tl.constexpr):
    """out[row, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, N + n]) for the block's pairs,
    row = the pair's position in the sorted order (block b's rows are b * BLOCK_M onwards, padding
    rows left unwritten), so that gemm2 reads each block's rows as one tile.

    w is `[E, 2N, K]` (`[gate; up]`), out `[blocks * BLOCK_M, N]`; N = I, K = H. HALF_M (0, 1 or
    2): a block whose real rows fit in half (a quarter) of BLOCK_M runs a tile of that height
    (_tile_rows). LORA: each pair's gate and up LoRA deltas added (`_up_tile`; PAIR_ROWS: where
    its shrink outputs are). FP8 (0, 1, 2): w float8_e4m3fn, scaled by S, a gather per element (1) or
    one scale per weight row a K tile (2; `fused_moe.fp8_kwargs`); 3 and 4 (W8A8,
    `quant.dequant.FP8_W8A8`, 4 with one weight scale a tile): x float8_e4m3fn too, its tokens' group
    scales at AS (`[T, K / BI]`), each K step's fp8 x fp8 dot scaled by both (`triton_utils.w8a8_step`).
    OUT_GROUP (> 0, BLOCK_N a multiple): the rows quantized for a W8A8 gemm2 in groups that wide, into
    IQ (float8_e4m3fn, like out) and IS (`[rows, N / OUT_GROUP]` fp32), instead of stored into out
    (besides, with LORA: the down delta's shrink reads them). SWAP: W8A8 dots as weight tile x rows
    (`_up_tile`)."""
    pdl_wait(PDL)
    pid_m, pid_n, pair, live = _block(N, num_valid, sorted_ptr, num_post_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    if live:
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        height = BLOCK_M
        if HALF_M >= 1:
            height = _tile_rows(pair, num_valid, BLOCK_M, HALF_M)
        first = pid_m * BLOCK_M   # out holds the rows in block order (gemm2 reads them as tiles)
        if height == BLOCK_M:
            _up_tile(x_ptr, w_ptr, w_desc, out_ptr, pair, first + tl.arange(0, BLOCK_M), expert, pid_n, num_valid,
                     N, K, stride_xm, stride_we, stride_wn, stride_om,
                     TOP_K, PRECISION, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA,
                     L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                     LORA, SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT, DELTA_FIRST, PAIR_ROWS,
                     S, stride_se, stride_sn, BO, BI, AS, stride_as, FP8, IQ, IS, stride_iq, stride_is, OUT_GROUP,
                     SWAP)
        elif height == BLOCK_M // 2:
            _up_tile(x_ptr, w_ptr, w_desc, out_ptr, _first_rows(sorted_ptr, pid_m, BLOCK_M, BLOCK_M // 2),
                     first + tl.arange(0, BLOCK_M // 2), expert,
                     pid_n, num_valid, N, K, stride_xm, stride_we, stride_wn, stride_om,
                     TOP_K, PRECISION, DOT_FP32, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, TMA,
                     L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                     LORA, SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT, DELTA_FIRST, PAIR_ROWS,
                     S, stride_se, stride_sn, BO, BI, AS, stride_as, FP8, IQ, IS, stride_iq, stride_is, OUT_GROUP,
                     SWAP)
        elif HALF_M >= 2:
            _up_tile(x_ptr, w_ptr, w_desc, out_ptr, _first_rows(sorted_ptr, pid_m, BLOCK_M, BLOCK_M // 4),
                     first + tl.arange(0, BLOCK_M // 4), expert,
                     pid_n, num_valid, N, K, stride_xm, stride_we, stride_wn, stride_om,
                     TOP_K, PRECISION, DOT_FP32, BLOCK_M // 4, BLOCK_N, BLOCK_K, EVEN_K, TMA,
                     L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                     LORA, SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT, DELTA_FIRST, PAIR_ROWS,
                     S, stride_se, stride_sn, BO, BI, AS, stride_as, FP8, IQ, IS, stride_iq, stride_is, OUT_GROUP,
                     SWAP)


@triton.jit
def _down_rows(a_ptr, a_desc, w_ptr, w_desc, out_ptr, weights_ptr, sorted_ptr, pair, pid_m, expert, pid_n,
               num_valid, N, K, stride_am, stride_we, stride_wn, stride_om,
               PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HALF_M: tl.constexpr, TMA: tl.constexpr,
               A_TMA: tl.constexpr, L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
               TOP_K: tl.constexpr, LORA: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
               KC: tl.constexpr, DELTA_PRECISION: tl.constexpr, DELTA_16BIT: tl.constexpr,
               DELTA_FIRST: tl.constexpr, DELTA_IN_K: tl.constexpr, R_FULL: tl.constexpr, S, stride_se, stride_sn,
               BO, BI, AS, stride_as, FP8: tl.constexpr, SWAP: tl.constexpr):
    """The down GEMM over the BLOCK_M rows `pair` of tile pid_m (positions pid_m * BLOCK_M on), one
    N tile: at full height, or (HALF_M) half or a quarter where that many rows hold its pairs."""
    height = BLOCK_M
    if HALF_M >= 1:
        height = _tile_rows(pair, num_valid, BLOCK_M, HALF_M)
    first = pid_m * BLOCK_M
    if height == BLOCK_M:
        _down_tile(a_ptr, a_desc, w_ptr, w_desc, out_ptr, weights_ptr, pair, first, expert,
                   pid_n, num_valid, N, K, stride_am, stride_we, stride_wn, stride_om,
                   PRECISION, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA, A_TMA,
                   L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                   TOP_K, LORA, SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT, DELTA_FIRST,
                   DELTA_IN_K, R_FULL, S, stride_se, stride_sn, BO, BI, AS, stride_as, FP8, SWAP)
    elif height == BLOCK_M // 2:
        _down_tile(a_ptr, a_desc, w_ptr, w_desc, out_ptr, weights_ptr,
                   _first_rows(sorted_ptr, pid_m, BLOCK_M, BLOCK_M // 2), first, expert, pid_n,
                   num_valid, N, K, stride_am, stride_we, stride_wn, stride_om,
                   PRECISION, DOT_FP32, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, TMA, False,
                   L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                   TOP_K, LORA, SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT, DELTA_FIRST,
                   DELTA_IN_K, R_FULL, S, stride_se, stride_sn, BO, BI, AS, stride_as, FP8, SWAP)
    elif HALF_M >= 2:
        _down_tile(a_ptr, a_desc, w_ptr, w_desc, out_ptr, weights_ptr,
                   _first_rows(sorted_ptr, pid_m, BLOCK_M, BLOCK_M // 4), first, expert, pid_n,
                   num_valid, N, K, stride_am, stride_we, stride_wn, stride_om,
                   PRECISION, DOT_FP32, BLOCK_M // 4, BLOCK_N, BLOCK_K, EVEN_K, TMA, False,
                   L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                   TOP_K, LORA, SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT, DELTA_FIRST,
                   DELTA_IN_K, R_FULL, S, stride_se, stride_sn, BO, BI, AS, stride_as, FP8, SWAP)


@triton.jit(do_not_specialize=["num_valid"])
def moe_gemm2_kernel(a_ptr, a_desc, w_ptr, w_desc, out_ptr, weights_ptr, sorted_ptr,
                     expert_ids_ptr, num_post_ptr, num_valid, N, K, stride_am, stride_we, stride_wn, stride_om,
                     PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
                     BLOCK_M: tl.constexpr, EXPERT_BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, HALF_M: tl.constexpr,
                     TMA: tl.constexpr, A_TMA: tl.constexpr,
                     L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                     TOP_K: tl.constexpr,
                     LORA: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_R: tl.constexpr, KC: tl.constexpr,
                     DELTA_PRECISION: tl.constexpr, DELTA_16BIT: tl.constexpr, DELTA_FIRST: tl.constexpr,
                     DELTA_IN_K: tl.constexpr, R_FULL: tl.constexpr, S, stride_se, stride_sn, BO, BI, AS,
                     stride_as, FP8: tl.constexpr, PDL: tl.constexpr, SWAP: tl.constexpr):
    """out[pair, n] = weight[pair] * (a[row] . w[e, n]), the block's rows of a in block order (as
    moe_gemm1_kernel writes them); w is `[E, N, K]` (N = H, K = I). A_TMA: full-height tiles of a
    come through `a_desc`. HALF_M as in moe_gemm1_kernel; LORA: each pair's down delta (`_down_tile`;
    DELTA_IN_K: as the K loop's last steps); FP8 as in moe_gemm1_kernel (3: a float8_e4m3fn, its
    rows' group scales at AS, `[rows, K / BI]`). EXPERT_BLOCK_M: the alignment's block height (the
    up GEMM's), a multiple of BLOCK_M: a program runs its block's tiles of BLOCK_M rows in turn,
    skipping those past the expert's pairs. SWAP as in moe_gemm1_kernel."""
    pdl_wait(PDL)
    if EXPERT_BLOCK_M == BLOCK_M:
        pid_m, pid_n, pair, live = _block(N, num_valid, sorted_ptr, num_post_ptr, BLOCK_M, BLOCK_N, GROUP_M)
        if live:
            expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
            _down_rows(a_ptr, a_desc, w_ptr, w_desc, out_ptr, weights_ptr, sorted_ptr, pair, pid_m, expert, pid_n,
                       num_valid, N, K, stride_am, stride_we, stride_wn, stride_om,
                       PRECISION, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, HALF_M, TMA, A_TMA,
                       L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                       TOP_K, LORA, SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT, DELTA_FIRST,
                       DELTA_IN_K, R_FULL, S, stride_se, stride_sn, BO, BI, AS, stride_as, FP8, SWAP)
    else:
        # a block's tiles in turn: those past its expert's pairs (real rows come first) cost no program
        pid_b, pid_n = _tile_ids(N, BLOCK_N, GROUP_M)
        if pid_b * EXPERT_BLOCK_M < tl.load(num_post_ptr):
            expert = tl.load(expert_ids_ptr + pid_b).to(tl.int64)
            for sub in tl.static_range(EXPERT_BLOCK_M // BLOCK_M):
                tile = pid_b * (EXPERT_BLOCK_M // BLOCK_M) + sub
                pair = tl.load(sorted_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
                if tl.min(pair, axis=0) < num_valid:
                    _down_rows(a_ptr, a_desc, w_ptr, w_desc, out_ptr, weights_ptr, sorted_ptr, pair, tile, expert,
                               pid_n, num_valid, N, K, stride_am, stride_we, stride_wn, stride_om,
                               PRECISION, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, HALF_M, TMA, A_TMA,
                               L_S, L_B, L_SCALE, L_SLOT, L_NS, L_R, stride_ls, stride_lbs, stride_lbe, stride_lbn,
                               TOP_K, LORA, SLOTS_PAD, BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT, DELTA_FIRST,
                               DELTA_IN_K, R_FULL, S, stride_se, stride_sn, BO, BI, AS, stride_as, FP8, SWAP)


@triton.jit
def _slot_sum(y_ptr, ids_ptr, d_ptr, t, offs, m, H, TOP_K: tl.constexpr, DELTA: tl.constexpr):
    """sum_j y[t*k + j] over a token's k weighted expert outputs, in fp32, in slot order; a pair
    of id < 0 (another rank's expert: no kernel wrote its row) adds nothing. DELTA: the sum
    starts from d[t] (fp32 `[T, H]`: the experts' LoRA down deltas, `moe_lora_expand_kernel`)."""
    if DELTA:
        acc = tl.load(d_ptr + t * H + offs, mask=m, other=0.0)
    else:
        acc = tl.zeros(offs.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        live = offs * 0 + tl.load(ids_ptr + t * TOP_K + j) >= 0   # a vector: the interpreter takes no scalar bool
        acc += tl.load(y_ptr + (t * TOP_K + j) * H + offs, mask=m & live, other=0.0).to(tl.float32)
    return acc


@triton.jit
def moe_sum_kernel(y_ptr, ids_ptr, d_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                   DELTA: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum_j y[t*k + j] in fp32 over the pairs of id >= 0 (ids `[T, k]`), plus d[t] where
    DELTA; y `[T*k, H]`, d and out `[T, H]` (all contiguous). out may be y where k is 1."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = offs < H
    acc = _slot_sum(y_ptr, ids_ptr, d_ptr, t, offs, m, H, TOP_K, DELTA)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def moe_sum_add_rms_norm_kernel(y_ptr, ids_ptr, d_ptr, x_ptr, nw_ptr, h_ptr, normed_ptr, H, eps, stride_xm, A,
                                S_OUT, SLOT, S, NR, stride_as, stride_an, XQ, XS, stride_xq, stride_xs, stride_xsg,
                                TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, SHRINK: tl.constexpr, N_PER: tl.constexpr,
                                GROUP: tl.constexpr, DELTA: tl.constexpr, PDL: tl.constexpr):
    """The top-k sum of `moe_sum_kernel` (d[t] added where DELTA; rounded to x's dtype, as that
    kernel stores it), then the residual add + RMSNorm of the layer after it on the whole row:
    h = x + sum, normed = RMSNorm(h) * nw. One program a token; h and normed `[T, H]` contiguous.
    SHRINK: also the LoRA shrink of the next linear, S_OUT `[T, NR]` = lora_shrink(normed, A,
    SLOT); program (t, j) takes N_PER of its NR outputs (`row_shrink`) and program (t, 0) stores h
    and normed.
    GROUP (> 0): normed also quantized for the next linear's W8A8 kernel, into XQ and its group
    scales into XS (`quant.act_quant.quantize_row`; with SHRINK by program (t, 0))."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    m = offs < H
    moe_out = _slot_sum(y_ptr, ids_ptr, d_ptr, t, offs, m, H, TOP_K, DELTA).to(x_ptr.dtype.element_ty)
    x = tl.load(x_ptr + t * stride_xm + offs, mask=m, other=0.0)
    if SHRINK or GROUP:
        h, normed = add_rms_norm_values(x, moe_out, nw_ptr, offs, m, H, eps)
        if tl.program_id(1) == 0:   # (without SHRINK the only program of the row)
            tl.store(h_ptr + t * H + offs, h, mask=m)
            tl.store(normed_ptr + t * H + offs, normed, mask=m)
            if GROUP:
                quantize_row(normed.to(tl.float32), m, XQ + t * stride_xq, XS + t * stride_xs, stride_xsg, H, GROUP,
                             BLOCK_H)
        if SHRINK:
            row_shrink(normed, A, S_OUT, SLOT, t, offs, m, S, NR, stride_as, stride_an, NR, tl.program_id(1) * N_PER,
                       N_PER)
    else:
        add_rms_norm_row(x, moe_out, nw_ptr, h_ptr + t * H, normed_ptr + t * H, offs, m, H, eps)
