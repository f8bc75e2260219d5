"""The W8A8 grouped GEMMs of the fused MoE as one launch: the up tiles (`_up_tile`, the intermediate
quantized by their epilogue) and the down tiles (`_down_tile`) of the same blocks.

Two launches leave the GPU short of work twice a layer: the up GEMM's last programs run on a few
SMs while the rest wait, and the down GEMM's first ones start only once all of them have ended,
then walk their chain of dependent loads (block, expert, weight tile) before any weight byte
arrives. Here a program takes the next item of one queue (an atomic counter): every up tile first,
then every down tile, so a down tile runs beside the up GEMM's last tiles. A down tile needs the
whole intermediate of its block, so it waits until all of that block's up tiles have bumped the
block's counter. Waiting cannot deadlock: by the time any program holds a down item, every up item
is held by a program already running, which waits on nothing. The program that finishes last puts
the queue, the counters and itself back to zero, so a CUDA graph replays the launch as it is.

The intermediate's tiles are read with pointer loads: TMA reads through the async proxy, which
the counters' release and acquire do not order."""

from __future__ import annotations

import triton
import triton.language as tl

from compiled.moe.fused_moe_kernels import _down_tile, _up_tile
from compiled.triton_utils import pdl_wait

ZERO_BLOCK = tl.constexpr(256)   # counters put back to zero a store


@triton.jit
def _wait_for(counter, target):
    """Spin until the block's counter reaches `target` (acquire: the up tiles' stores are visible)."""
    while tl.atomic_add(counter, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit(do_not_specialize=["num_valid"])
def moe_up_down_kernel(x_ptr, w13_ptr, w13_desc, inter_ptr, iq_ptr, is_ptr, w2_ptr, w2_desc, y_ptr, weights_ptr,
                       sorted_ptr, expert_ids_ptr, num_post_ptr, sync_ptr, num_valid, max_blocks, I, H,
                       stride_xm, stride_w13e, stride_w13n, stride_inter, stride_iq, stride_is,
                       stride_w2e, stride_w2n, stride_y, XS, stride_xs,
                       S1, stride_s1e, stride_s1n, BO1, BI1, S2, stride_s2e, stride_s2n, BO2, BI2,
                       TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, UP_N: tl.constexpr, UP_K: tl.constexpr,
                       DOWN_N: tl.constexpr, DOWN_K: tl.constexpr, UP_EVEN_K: tl.constexpr,
                       DOWN_EVEN_K: tl.constexpr, UP_TMA: tl.constexpr, DOWN_TMA: tl.constexpr,
                       UP_SWAP: tl.constexpr, DOWN_SWAP: tl.constexpr, FP8_UP: tl.constexpr,
                       FP8_DOWN: tl.constexpr, OUT_GROUP: tl.constexpr, PDL: tl.constexpr):
    """Items [0, max_blocks * cdiv(I, UP_N)): block item // cdiv(I, UP_N)'s up tile (x fp8 with
    its group scales at XS into iq / is_, `moe_gemm1_kernel`'s OUT_GROUP store); the rest: down
    tiles (iq at is_'s scales into y, `moe_gemm2_kernel`'s). sync_ptr: max_blocks block counters,
    then the queue, then the count of programs done, all zero at launch and left so."""
    pdl_wait(PDL)
    up_tiles = tl.cdiv(I, UP_N)
    n_up = max_blocks * up_tiles
    total = n_up + max_blocks * tl.cdiv(H, DOWN_N)
    item = tl.atomic_add(sync_ptr + max_blocks, 1, sem="relaxed", scope="gpu")
    num_post = tl.load(num_post_ptr)
    rows = tl.arange(0, BLOCK_M)
    if item < n_up:
        pid_m = item // up_tiles
        if pid_m * BLOCK_M < num_post:
            pair = tl.load(sorted_ptr + pid_m * BLOCK_M + rows)
            expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
            _up_tile(x_ptr, w13_ptr, w13_desc, inter_ptr, pair, pid_m * BLOCK_M + rows, expert, item % up_tiles,
                     num_valid, I, H, stride_xm, stride_w13e, stride_w13n, stride_inter,
                     TOP_K, "tf32", False, BLOCK_M, UP_N, UP_K, UP_EVEN_K, UP_TMA,
                     x_ptr, x_ptr, x_ptr, x_ptr, 0, 0, 0, 0, 0, 0, False, 1, 16, 16, "ieee", False, False, False,
                     S1, stride_s1e, stride_s1n, BO1, BI1, XS, stride_xs, FP8_UP, iq_ptr, is_ptr, stride_iq,
                     stride_is, OUT_GROUP, UP_SWAP)
            tl.debug_barrier()   # every thread's stores before the release
            tl.atomic_add(sync_ptr + pid_m, 1, sem="release", scope="gpu")
    else:
        down = item - n_up
        pid_m = down // tl.cdiv(H, DOWN_N)
        if pid_m * BLOCK_M < num_post:
            pair = tl.load(sorted_ptr + pid_m * BLOCK_M + rows)
            expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
            _wait_for(sync_ptr + pid_m, up_tiles)
            _down_tile(iq_ptr, iq_ptr, w2_ptr, w2_desc, y_ptr, weights_ptr, pair, pid_m * BLOCK_M, expert,
                       down % tl.cdiv(H, DOWN_N), num_valid, H, I, stride_iq, stride_w2e, stride_w2n, stride_y,
                       "tf32", False, BLOCK_M, DOWN_N, DOWN_K, DOWN_EVEN_K, DOWN_TMA, False,
                       iq_ptr, iq_ptr, iq_ptr, iq_ptr, 0, 0, 0, 0, 0, 0, TOP_K, False, 1, 16, 16, "ieee", False,
                       False, False, False, S2, stride_s2e, stride_s2n, BO2, BI2, is_ptr, stride_is, FP8_DOWN,
                       DOWN_SWAP)
    tl.debug_barrier()   # the program's own work (and its reads of the counters) before it arrives
    if tl.atomic_add(sync_ptr + max_blocks + 1, 1, sem="acq_rel", scope="gpu") == total - 1:
        for z in range(0, max_blocks + 2, ZERO_BLOCK):
            offs = z + tl.arange(0, ZERO_BLOCK)
            tl.store(sync_ptr + offs, tl.zeros([ZERO_BLOCK], dtype=tl.int32), mask=offs < max_blocks + 2)
