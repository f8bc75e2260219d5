"""The LoRA shrink of the fused MoE with expert LoRA (`expert_lora.py`); the expands run inside
the base grouped GEMMs (`fused_moe_kernels`, LORA=True: `_pair_delta` in their epilogues).

The pairs are sorted by expert into BLOCK_M blocks as for the base MoE (`moe_align_block_size`),
and every per-pair buffer is kept in block order (row = the pair's position), as the
intermediate is. A block's rows share an expert but not a slot (each token has its own adapter).

`moe_lora_shrink_kernel`, grid (blocks, S): program (b, s) computes, for the rows of block b whose
token's slot is s, `a[s, e] @ row` (fp32, one tensor-core dot a K step, the other rows masked)
into `s_out` at the rows' positions: x's token rows (GATHER: gate/up, `a13 [S, E, 2R, H]`) or the
intermediate's block rows (down, `a2 [S, E, R, I]`). Programs whose slot is absent from their
block exit after the slot loads; rows without an adapter (slot -1, or outside [0, S)) are not
written and never read."""

from __future__ import annotations

import triton
import triton.language as tl

from compiled.triton_utils import masked_dot_t, pdl_wait


@triton.jit
def _pair_slots(SLOT, pair, num_valid, S, TOP_K: tl.constexpr):
    """(row is a real pair, its token, its slot: -1 for padding rows and slots outside [0, S))."""
    row_ok = pair < num_valid
    token = tl.where(row_ok, pair // TOP_K, 0).to(tl.int64)
    slots = tl.load(SLOT + token, mask=row_ok, other=-1).to(tl.int32)
    slots = tl.where(row_ok & (slots >= 0) & (slots < S), slots, -1)
    return row_ok, token, slots


@triton.jit(do_not_specialize=["num_valid"])
def moe_lora_shrink_kernel(X, A, OUT, SLOT, sorted_ptr, expert_ids_ptr, num_post_ptr, num_valid, S, NR, K,
                           stride_xm, stride_as, stride_ae, stride_an, stride_om,
                           TOP_K: tl.constexpr, GATHER: tl.constexpr, PRECISION: tl.constexpr,
                           DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """OUT[pos, n] = sum_k row[k] * A[s, e, n, k] (fp32, n < NR) for block pid_m's rows of slot
    s = program_id(1); row = X[token] (GATHER) or X[pos] (the intermediate, block order)."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    num_post = tl.load(num_post_ptr)
    if pid_m * BLOCK_M < num_post:
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_m)
        row_ok, token, slots = _pair_slots(SLOT, pair, num_valid, S, TOP_K)
        rows = slots == s
        if tl.sum(rows.to(tl.int32), axis=0) > 0:
            expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
            pos = (pid_m * BLOCK_M + offs_m).to(tl.int64)
            offs_n = tl.arange(0, BLOCK_N)
            n_ok = offs_n < NR
            offs_k = tl.arange(0, BLOCK_K)
            if GATHER:
                x_ptrs = X + token[:, None] * stride_xm + offs_k[None, :]
            else:
                x_ptrs = X + pos[:, None] * stride_xm + offs_k[None, :]
            a_ptrs = A + s.to(tl.int64) * stride_as + expert * stride_ae + offs_n[:, None] * stride_an + offs_k[None, :]
            acc = masked_dot_t(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), x_ptrs, a_ptrs, rows, n_ok, 0, K,
                               BLOCK_K, EVEN_K, DOT_FP32, PRECISION)
            tl.store(OUT + pos[:, None] * stride_om + offs_n[None, :], acc, mask=rows[:, None] & n_ok[None, :])
