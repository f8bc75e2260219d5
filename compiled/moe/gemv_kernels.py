"""The fused MoE of one token as two GEMVs (Triton): no tensor-core tile, the skinny GEMM's GEMV
mode applied to the k experts' weights.

At one token each (token, slot) pair is a 16-row tensor-core tile with one live row. Here a
program owns BLOCK_N output columns of one pair's expert, loads the weight tile straight into
registers and multiplies it by the pair's row into an fp32 `[BLOCK_N, BLOCK_K]` accumulator,
reduced along K once after the loop:

* `moe_gemv_up_kernel`: silu(gate) * up for BLOCK_N intermediate columns of pair p (its gate and
  up rows of `w13[e]`), into row p of the intermediate `[k, I]`;
* `moe_gemv_down_kernel`: weight[p] * (inter[p] . w2[e]) for BLOCK_N output columns, into row p
  of `y [k, H]`, for the top-k sum after it (`moe_sum_kernel` or the next norm's kernel). Where
  its FP8 K range fits (`triton_utils.preload_fits`) it reads its pair's id and that range before
  the PDL wait, so its weights stream while the up GEMV runs; the up GEMV then lets it in only
  after its own wait, when the routing that wrote the ids has finished.

Each rounds its outputs where the tile kernels (`fused_moe_kernels._up_tile`, `_down_tile`) do,
so over 16-bit experts the results differ from theirs only in the order of the fp32 sums. The
torch reference is `fused_moe.fused_moe_ref`. FP8 (float8_e4m3fn experts): each weight tile is
scaled in registers (scales `S [E, rows / BO, K / BI]`), so a step reads the FP8 bytes: where a
tile takes a scale per row and block, runs of CHUNK products are summed first and each run scaled
once (`triton_utils.chunk_scaled_dots`; the accumulator is `[BLOCK_N, BLOCK_K / CHUNK]`), else
each element (`scaled_tile`, for blocks the tiles do not align with). The weight stays fp32 (PTX's
conversion where FP8_ASM, `triton_utils.fp8_f32`), not rounded to the activations' dtype as the
tiles' dot operands and the dequantized reference are: that rounding is a conversion an element
on a unit that does a few a clock, and would bound the GEMV above the bytes' time."""

from __future__ import annotations

import triton
import triton.language as tl

from compiled.triton_utils import (chunk_scaled_dots, fp8_f32, pdl_let_next_in, pdl_wait, pdl_wait_only, preload_tiles,
                                   preloaded_dots, row_scaled, row_slice, scaled_tile, weight_tile)


@triton.jit
def _rows_dot(a_ptr, w_ptr, rows, row_ok, K, stride_wn, second, s_ptr, stride_sn, BO, BI,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PAIRED: tl.constexpr,
              FP8: tl.constexpr, KB: tl.constexpr, STAGES: tl.constexpr, CHUNK: tl.constexpr, FP8_ASM: tl.constexpr):
    """`[BLOCK_N]` fp32: the weight rows `rows` (from w_ptr) dotted with the vector at a_ptr, and
    with PAIRED the rows `second` further on too, in the same K loop (without: the first twice,
    no second reduction). FP8: the rows scaled by their blocks of s_ptr (2: a scale a run of CHUNK
    products, `chunk_scaled_dots`, where CHUNK > 1, else `row_scaled`, KB blocks a tile; 1:
    `scaled_tile`), FP8_ASM: converted by `fp8_f32`'s PTX. STAGES: K tiles in flight (the loop
    software-pipelined through shared memory; 1: each step's loads issued as it starts)."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_ok = k0 + offs_k < K
        a = row_slice(a_ptr, k0 + offs_k, K, EVEN_K)
        acc += _rows_step(w_ptrs, a, rows, row_ok, k_ok, k0, K, s_ptr, stride_sn, BO, BI, EVEN_K, FP8, KB, CHUNK,
                          FP8_ASM)
        if PAIRED:
            acc2 += _rows_step(w_ptrs + second * stride_wn, a, rows + second, row_ok, k_ok, k0, K, s_ptr, stride_sn,
                               BO, BI, EVEN_K, FP8, KB, CHUNK, FP8_ASM)
        w_ptrs += BLOCK_K
    total = tl.sum(acc, axis=1)
    if PAIRED:
        return total, tl.sum(acc2, axis=1)
    return total, total


@triton.jit
def _rows_step(w_ptrs, a, rows, row_ok, k_ok, k0, K, s_ptr, stride_sn, BO, BI, EVEN_K: tl.constexpr,
               FP8: tl.constexpr, KB: tl.constexpr, CHUNK: tl.constexpr, FP8_ASM: tl.constexpr):
    """One K step of `_rows_dot` for the rows `rows`: `[BLOCK_N, BLOCK_K / CHUNK]` fp32."""
    w = weight_tile(w_ptrs, row_ok, k_ok, EVEN_K)
    if FP8 == 2 and CHUNK > 1:
        out = chunk_scaled_dots(fp8_f32(w, FP8_ASM), a, s_ptr, rows, row_ok, k0, K, stride_sn, BO, BI, KB, CHUNK)
    elif FP8 == 2:
        out = row_scaled(w, s_ptr, rows, row_ok, k0, K, stride_sn, BO, BI, tl.float32, KB, FP8_ASM) * a[None, :]
    else:
        ok = row_ok[:, None] & k_ok[None, :]
        out = scaled_tile(w, s_ptr, rows[:, None], (k0 + tl.arange(0, w.shape[1]))[None, :], ok, stride_sn, BO, BI,
                          tl.float32, FP8).to(tl.float32) * a[None, :]
    return out


@triton.jit
def _pair_block(ids_ptr, N, BLOCK_N: tl.constexpr):
    """This program's pair, its BLOCK_N output columns (offsets, valid, clamped row indices), the
    columns whose weights it reads (none for a pair of id < 0, another rank's expert: its row is
    stored as zeros) and the pair's expert (clamped to 0)."""
    n_blocks = tl.cdiv(N, BLOCK_N)
    pair = tl.program_id(0) // n_blocks
    offs_n = (tl.program_id(0) % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    read = n_ok & (offs_n * 0 + expert >= 0)   # a vector test: the interpreter takes no scalar bool in a mask
    return pair, offs_n, n_ok, read, tl.where(n_ok, offs_n, 0).to(tl.int64), tl.maximum(expert, 0)


@triton.jit
def moe_gemv_up_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, N, K, stride_we, stride_wn, stride_om,
                       S, stride_se, stride_sn, BO, BI,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FP8: tl.constexpr,
                       KB: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr, CHUNK: tl.constexpr,
                       FP8_ASM: tl.constexpr, LET_IN_AFTER_WAIT: tl.constexpr = False):
    """out[p, n] = silu(x . w[e, n]) * (x . w[e, N + n]), e = ids[p], for the token x `[K]`.
    LET_IN_AFTER_WAIT: the down GEMV after it is let in once the ids are written (the routing
    before has finished), for it to read them, and its weights, before its own wait."""
    if LET_IN_AFTER_WAIT:
        pdl_wait_only(PDL)
        pdl_let_next_in(PDL)
    else:
        pdl_wait(PDL)
    pair, offs_n, n_ok, read, rows, expert = _pair_block(ids_ptr, N, BLOCK_N)
    w_e = w_ptr + expert * stride_we
    gate, up = _rows_dot(x_ptr, w_e, rows, read, K, stride_wn, N, S + expert * stride_se, stride_sn, BO, BI,
                         BLOCK_N, BLOCK_K, EVEN_K, True, FP8, KB, STAGES, CHUNK, FP8_ASM)
    # round like the unfused model: gate/up in the activation dtype, silu, product
    dt = out_ptr.dtype.element_ty
    gate = gate.to(dt).to(tl.float32)
    up = up.to(dt).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + pair * stride_om + offs_n, (act * up).to(dt), mask=n_ok)


@triton.jit
def moe_gemv_down_kernel(a_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, N, K, stride_am, stride_we, stride_wn,
                         stride_om, S, stride_se, stride_sn, BO, BI, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, FP8: tl.constexpr, KB: tl.constexpr, PDL: tl.constexpr,
                         STAGES: tl.constexpr, CHUNK: tl.constexpr, FP8_ASM: tl.constexpr, PRELOAD: tl.constexpr = 0):
    """out[p, n] = weight[p] * (a[p] . w[e, n]), e = ids[p]. PRELOAD (> 0: FP8 runs of products
    over PRELOAD K steps, `preload_fits`, the up GEMV before letting it in after its wait): the
    ids, every weight tile and its scales read before the wait, so that the program streams its
    expert's weights while the up GEMV runs."""
    if PRELOAD > 0:
        pair, offs_n, n_ok, read, rows, expert = _pair_block(ids_ptr, N, BLOCK_N)
        w_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
        w0, s0, w1, s1, w2, s2, w3, s3 = preload_tiles(w_ptrs, S + expert * stride_se, rows, read, 0, K, K, stride_sn,
                                                       BO, BI, BLOCK_K, EVEN_K, KB, PRELOAD)
        pdl_wait(PDL)
        acc = tl.sum(preloaded_dots(a_ptr + pair * stride_am, w0, s0, w1, s1, w2, s2, w3, s3, 0, K, BLOCK_K, KB, CHUNK,
                                    FP8_ASM, EVEN_K, PRELOAD), axis=1)
    else:
        pdl_wait(PDL)
        pair, offs_n, n_ok, read, rows, expert = _pair_block(ids_ptr, N, BLOCK_N)
        acc, _ = _rows_dot(a_ptr + pair * stride_am, w_ptr + expert * stride_we, rows, read, K, stride_wn, 0,
                           S + expert * stride_se, stride_sn, BO, BI, BLOCK_N, BLOCK_K, EVEN_K, False, FP8, KB, STAGES,
                           CHUNK, FP8_ASM)
    dt = out_ptr.dtype.element_ty
    w = tl.load(weights_ptr + pair).to(dt).to(tl.float32)
    tl.store(out_ptr + pair * stride_om + offs_n, (acc.to(dt).to(tl.float32) * w).to(dt), mask=n_ok)
