"""Hopper's warp-specialized W8A8 grouped GEMMs for long batches (Gluon): the fused MoE's up and
down GEMMs over 128 x 128 block-scaled FP8 experts, as `moe_gemm1_kernel` / `moe_gemm2_kernel`
compute them with FP8=4 (one weight scale a tile), the intermediate quantized in the up GEMM.

Each program is persistent (one per SM, tiles in turn) and split into partitions that hand shared
memory stages to each other through mbarriers, with no CTA-wide barrier in the K loop:
  - a loader warp group fills S stages ahead: the weight tiles (and the down GEMM's activation
    rows, contiguous in block order) by TMA, the up GEMM's gathered token rows by cp.async;
  - two consumer warp groups run the wgmma K loop, each K step's fp8 x fp8 product (fp32 on the
    tensor cores) scaled into its accumulator by the step's activation and weight scales.
The up GEMM's consumers take the gate and the up half of the same 64 x 128 tile: the gate's owner
leaves silu(gate) in shared memory and moves on to the next tile while the other finishes this
one (silu(gate) * up, quantized in one 128-wide group a row). The down GEMM's two consumers take
the two 64-row halves of a 128 x 128 tile. Rounding follows the Triton kernels step by step (the
gate and up in the activations' dtype, silu, the product; the down product, its routing weight),
so both paths give the same intermediate and outputs to within the accumulation order.

GPU only (Gluon has no interpreter): `bench/ws_moe_check.py` and the GPU tests compare them with
the Triton kernels, which the CPU tests hold to the torch reference."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)

FMAX = gl.constexpr(448.0)
EPS = gl.constexpr(1e-10)   # act_quant.ACT_EPS: an all-zero group's maximum
LOAD_WARPS = gl.constexpr(4)   # the up GEMM's loader warps (they gather the token rows)
CONSUMER_REGS = gl.constexpr(232)        # setmaxnreg of the consumers; the loader gives its registers up
LOADER_REGS = gl.constexpr(40)


@gluon.jit
def _tile(t, num_m, n_n, GROUP_M: gl.constexpr):
    """Tile t's (pid_m, pid_n), grouped along M so that tiles sharing weight tiles run together."""
    in_group = GROUP_M * n_n
    first_m = (t // in_group) * GROUP_M
    group_m = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % in_group) % group_m, (t % in_group) // group_m


@gluon.jit
def _live_tiles(num_post_ptr, n_n, BM: gl.constexpr):
    """(M tiles holding the aligned pairs, all tiles): the grid's programs walk the second."""
    num_m = (gl.load(num_post_ptr) + BM - 1) // BM
    return num_m, num_m * n_n


# ----------------------------------------------------------------------------- up GEMM


@gluon.jit
def _up_loader(x, stride_x, w_desc, sorted_ids, expert_ids, num_post, a_smem, g_smem, u_smem, ready, empty,
               num_valid, N, K, n_n, TOP_K: gl.constexpr, GROUP_M: gl.constexpr):
    S: gl.constexpr = a_smem.shape[0]
    BM: gl.constexpr = a_smem.shape[1]
    BK: gl.constexpr = a_smem.shape[2]
    HN: gl.constexpr = g_smem.shape[1]
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [LOAD_WARPS, 1], [1, 0])
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
    ks = gl.arange(0, BK, layout=gl.SliceLayout(0, ld))
    num_m, n_tiles = _live_tiles(num_post, n_n, BM)
    n_k = K // BK
    step = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile(t, num_m, n_n, GROUP_M)
        if gl.load(sorted_ids + pid_m * BM) < num_valid:   # a tile past its expert's pairs is skipped
            e = gl.load(expert_ids + pid_m)
            pair = gl.load(sorted_ids + pid_m * BM + rows)
            tok = gl.where(pair < num_valid, pair // TOP_K, 0).to(gl.int64)
            a_ptrs = x + tok[:, None] * stride_x + ks[None, :]
            for h in gl.static_range(2):   # the tile's two column halves in turn
                g_row = e * 2 * N + pid_n * 2 * HN + h * HN
                for k in range(n_k):
                    s = step % S
                    mbarrier.wait(empty.index(s), ((step // S) & 1) ^ 1)
                    async_copy.async_copy_global_to_shared(a_smem.index(s), a_ptrs + k * BK)
                    async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
                    mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(w_desc, [g_row, k * BK], ready.index(s), g_smem.index(s))
                    tma.async_copy_global_to_shared(w_desc, [g_row + N, k * BK], ready.index(s), u_smem.index(s))
                    step += 1


@gluon.jit
def _gate_up_step(a, g, u, p, acc_g, acc_u, sa, sg, su):
    tok = warpgroup_mma(a, g.permute((1, 0)), p, use_acc=False, is_async=True)
    p = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
    acc_g = acc_g + p * (sa * sg)[:, None]
    tok = warpgroup_mma(a, u.permute((1, 0)), p, use_acc=False, is_async=True)
    p = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
    return acc_g, acc_u + p * (sa * su)[:, None], p


@gluon.jit
def _merge(acc_a, acc_b, x_smem, x_bar, xc, HALF: gl.constexpr, mma: gl.constexpr, TWO: gl.constexpr):
    """A short tile's K-split partial sums (acc_a, and with TWO acc_b): the second consumer's
    handed to the first through x_smem, added there."""
    if HALF == 1:
        x_smem.index(0).store(acc_a)
        if TWO:
            x_smem.index(1).store(acc_b)
        mbarrier.arrive(x_bar, count=1)
    else:
        mbarrier.wait(x_bar, xc & 1)
        acc_a = acc_a + x_smem.index(0).load(mma)
        if TWO:
            acc_b = acc_b + x_smem.index(1).load(mma)
    return acc_a, acc_b


@gluon.jit
def _up_product(a_smem, g_smem, u_smem, ready, empty, x_smem, x_bar, xc, as_rows, s_g, s_u, step, n_k, short,
                HALF: gl.constexpr, mma: gl.constexpr):
    """One column half's K loop: (silu(gate) * up as the Triton kernel rounds it, the next step).
    A short tile (real rows in its first half only) has both consumers on those rows, each on
    every other K step, the partial sums merged (`_merge`)."""
    S: gl.constexpr = a_smem.shape[0]
    HM: gl.constexpr = a_smem.shape[1] // 2
    HN: gl.constexpr = g_smem.shape[1]
    acc_g = gl.zeros([HM, HN], gl.float32, mma)
    acc_u = gl.zeros([HM, HN], gl.float32, mma)
    p = gl.zeros([HM, HN], gl.float32, mma)
    for k in range(n_k):
        s = step % S
        sa = gl.load(as_rows + k)
        sg = gl.load(s_g + k)
        su = gl.load(s_u + k)
        mbarrier.wait(ready.index(s), (step // S) & 1)
        if short:
            if k % 2 == HALF:
                acc_g, acc_u, p = _gate_up_step(a_smem.index(s).slice(0, HM), g_smem.index(s), u_smem.index(s), p,
                                                acc_g, acc_u, sa, sg, su)
        else:
            acc_g, acc_u, p = _gate_up_step(a_smem.index(s).slice(HALF * HM, HM), g_smem.index(s), u_smem.index(s),
                                            p, acc_g, acc_u, sa, sg, su)
        mbarrier.arrive(empty.index(s), count=1)
        step += 1
    if short:
        acc_g, acc_u = _merge(acc_g, acc_u, x_smem, x_bar, xc, HALF, mma, True)
        xc += 1
    gate = acc_g.to(gl.bfloat16).to(gl.float32)
    act = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
    return (act * acc_u.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16), step, xc


@gluon.jit
def _up_store(o0, o1, rows, row_ok, iq, stride_iq, is_, stride_is, pid_n, mma: gl.constexpr):
    """Both column halves' rows quantized in one 128-wide group a row."""
    HN: gl.constexpr = o0.shape[1]
    f0 = gl.where(row_ok[:, None], o0.to(gl.float32), 0.0)
    f1 = gl.where(row_ok[:, None], o1.to(gl.float32), 0.0)
    scale = gl.maximum(gl.maximum(gl.max(gl.abs(f0), axis=1), gl.max(gl.abs(f1), axis=1)), EPS) / FMAX
    r = rows.to(gl.int64)
    cols = pid_n * 2 * HN + gl.arange(0, HN, layout=gl.SliceLayout(0, mma))
    dst = iq + r[:, None] * stride_iq + cols[None, :]
    gl.store(dst, gl.minimum(gl.maximum(f0 / scale[:, None], -FMAX), FMAX).to(gl.float8e4nv), mask=row_ok[:, None])
    gl.store(dst + HN, gl.minimum(gl.maximum(f1 / scale[:, None], -FMAX), FMAX).to(gl.float8e4nv),
             mask=row_ok[:, None])
    gl.store(is_ + r * stride_is + pid_n, scale, mask=row_ok)


@gluon.jit
def _up_half(a_smem, g_smem, u_smem, ready, empty, x_smem, x_bar, xs, stride_xs, ws, stride_se, stride_sn,
             sorted_ids, expert_ids, num_post, iq, stride_iq, is_, stride_is, num_valid, N, K, n_n,
             HALF: gl.constexpr, TOP_K: gl.constexpr, GROUP_M: gl.constexpr):
    """The rows HALF * BM / 2 on of each tile (a short tile's first half): silu(gate) * up over
    both column halves, quantized in one group a row."""
    BM: gl.constexpr = a_smem.shape[1]
    BK: gl.constexpr = a_smem.shape[2]
    HN: gl.constexpr = g_smem.shape[1]
    HM: gl.constexpr = BM // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HN, 32])
    num_m, n_tiles = _live_tiles(num_post, n_n, BM)
    n_k = K // BK
    step = 0
    xc = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile(t, num_m, n_n, GROUP_M)
        if gl.load(sorted_ids + pid_m * BM) < num_valid:
            e = gl.load(expert_ids + pid_m).to(gl.int64)
            short = gl.load(sorted_ids + pid_m * BM + HM) >= num_valid
            rows = pid_m * BM + gl.arange(0, HM, layout=gl.SliceLayout(1, mma))
            if HALF == 1:
                rows += gl.where(short, 0, HM)
            pair = gl.load(sorted_ids + rows)
            row_ok = pair < num_valid
            as_rows = xs + gl.where(row_ok, pair // TOP_K, 0).to(gl.int64) * stride_xs
            s_g = ws + e * stride_se + pid_n * stride_sn   # a 128-row scale block: both halves' gate rows
            s_u = s_g + (N // (2 * HN)) * stride_sn
            o0, step, xc = _up_product(a_smem, g_smem, u_smem, ready, empty, x_smem, x_bar, xc, as_rows, s_g, s_u,
                                       step, n_k, short, HALF, mma)
            o1, step, xc = _up_product(a_smem, g_smem, u_smem, ready, empty, x_smem, x_bar, xc, as_rows, s_g, s_u,
                                       step, n_k, short, HALF, mma)
            if HALF == 0:
                _up_store(o0, o1, rows, row_ok, iq, stride_iq, is_, stride_is, pid_n, mma)
            elif short.to(gl.int32) == 0:
                _up_store(o0, o1, rows, row_ok, iq, stride_iq, is_, stride_is, pid_n, mma)


@gluon.jit
def _up_top(a_smem, g_smem, u_smem, ready, empty, x_smem, x_bar, xs, stride_xs, ws, stride_se, stride_sn, sorted_ids,
            expert_ids, num_post, iq, stride_iq, is_, stride_is, num_valid, N, K, n_n,
            TOP_K: gl.constexpr, GROUP_M: gl.constexpr):
    _up_half(a_smem, g_smem, u_smem, ready, empty, x_smem, x_bar, xs, stride_xs, ws, stride_se, stride_sn, sorted_ids, expert_ids,
             num_post, iq, stride_iq, is_, stride_is, num_valid, N, K, n_n, 0, TOP_K, GROUP_M)


@gluon.jit
def _up_bottom(a_smem, g_smem, u_smem, ready, empty, x_smem, x_bar, xs, stride_xs, ws, stride_se, stride_sn,
               sorted_ids, expert_ids, num_post, iq, stride_iq, is_, stride_is, num_valid, N, K, n_n,
               TOP_K: gl.constexpr, GROUP_M: gl.constexpr):
    _up_half(a_smem, g_smem, u_smem, ready, empty, x_smem, x_bar, xs, stride_xs, ws, stride_se, stride_sn, sorted_ids, expert_ids,
             num_post, iq, stride_iq, is_, stride_is, num_valid, N, K, n_n, 1, TOP_K, GROUP_M)


@gluon.jit
def ws_up_kernel(x, stride_x, xs, stride_xs, w_desc, ws, stride_se, stride_sn, iq, stride_iq, is_, stride_is,
                 sorted_ids, expert_ids, num_post, num_valid, N, K, n_n, BM: gl.constexpr, TOP_K: gl.constexpr,
                 GROUP_M: gl.constexpr, S: gl.constexpr, num_warps: gl.constexpr):
    """iq/is_ (rows in block order) <- silu(x . gate) * (x . up) quantized per row in 128-wide
    groups, for BM-row tiles (the alignment blocks) by 128 columns; x float8 with group scales
    xs `[T, K / 128]`, w through `w_desc` (`[E * 2N, K]`, block `[128, 128]`), its block scales
    ws `[E, 2N / 128, K / 128]`."""
    BK: gl.constexpr = w_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [S, BM, BK], a_layout)
    g_smem = gl.allocate_shared_memory(gl.float8e4nv, [S, BN, BK], w_desc.layout)
    u_smem = gl.allocate_shared_memory(gl.float8e4nv, [S, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=32 * LOAD_WARPS + 1)   # each loader thread's rows + the TMA bytes
        mbarrier.init(empty.index(i), count=2)                     # both consumers done with the stage
    x_smem = gl.allocate_shared_memory(gl.float32, [2, BM // 2, BN], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    x_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(x_bar, count=1)
    fence_async_shared()
    mma_args = (a_smem, g_smem, u_smem, ready, empty, x_smem, x_bar, xs, stride_xs, ws, stride_se, stride_sn, sorted_ids, expert_ids,
                num_post, iq, stride_iq, is_, stride_is, num_valid, N, K, n_n, TOP_K, GROUP_M)
    load_args = (x, stride_x, w_desc, sorted_ids, expert_ids, num_post, a_smem, g_smem, u_smem, ready, empty,
                 num_valid, N, K, n_n, TOP_K, GROUP_M)
    gl.warp_specialize([(_up_top, mma_args), (_up_bottom, mma_args), (_up_loader, load_args)],
                       [4, LOAD_WARPS], [CONSUMER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------- down GEMM


@gluon.jit
def _down_loader(a_desc, w_desc, sorted_ids, expert_ids, num_post, a_smem, b_smem, ready, empty, num_valid, H, n_k,
                 n_n, GROUP_M: gl.constexpr):
    S: gl.constexpr = a_smem.shape[0]
    BM: gl.constexpr = a_smem.shape[1]
    BK: gl.constexpr = a_smem.shape[2]
    BN: gl.constexpr = b_smem.shape[1]
    num_m, n_tiles = _live_tiles(num_post, n_n, BM)
    step = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile(t, num_m, n_n, GROUP_M)
        if gl.load(sorted_ids + pid_m * BM) < num_valid:
            e = gl.load(expert_ids + pid_m)
            for k in range(n_k):
                s = step % S
                mbarrier.wait(empty.index(s), ((step // S) & 1) ^ 1)
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [pid_m * BM, k * BK], ready.index(s), a_smem.index(s))
                tma.async_copy_global_to_shared(w_desc, [e * H + pid_n * BN, k * BK], ready.index(s),
                                                b_smem.index(s))
                step += 1


@gluon.jit
def _down_half(a_smem, b_smem, ready, empty, x_smem, x_bar, a_s, stride_as, ws, stride_se, stride_sn, weights, y,
               stride_y, sorted_ids, expert_ids, num_post, num_valid, n_k, n_n, HALF: gl.constexpr,
               GROUP_M: gl.constexpr):
    """The rows HALF * BM / 2 on of each tile: y[pair] <- weight[pair] * (a[row] . w2[e]); a short
    tile (real rows in its first half only) as in `_up_product`."""
    S: gl.constexpr = a_smem.shape[0]
    BM: gl.constexpr = a_smem.shape[1]
    BN: gl.constexpr = b_smem.shape[1]
    HM: gl.constexpr = BM // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    num_m, n_tiles = _live_tiles(num_post, n_n, BM)
    step = 0
    xc = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile(t, num_m, n_n, GROUP_M)
        if gl.load(sorted_ids + pid_m * BM) < num_valid:
            e = gl.load(expert_ids + pid_m).to(gl.int64)
            short = gl.load(sorted_ids + pid_m * BM + HM) >= num_valid
            rows = pid_m * BM + gl.arange(0, HM, layout=gl.SliceLayout(1, mma))
            if HALF == 1:
                rows += gl.where(short, 0, HM)
            pair = gl.load(sorted_ids + rows)
            row_ok = pair < num_valid
            as_rows = a_s + rows.to(gl.int64) * stride_as
            s_w = ws + e * stride_se + pid_n * stride_sn
            acc = gl.zeros([HM, BN], gl.float32, mma)
            p = gl.zeros([HM, BN], gl.float32, mma)
            for k in range(n_k):
                s = step % S
                scale = gl.load(as_rows + k) * gl.load(s_w + k)
                mbarrier.wait(ready.index(s), (step // S) & 1)
                if short:
                    if k % 2 == HALF:
                        acc, p = _down_step(a_smem.index(s).slice(0, HM), b_smem.index(s), p, acc, scale)
                else:
                    acc, p = _down_step(a_smem.index(s).slice(HALF * HM, HM), b_smem.index(s), p, acc, scale)
                mbarrier.arrive(empty.index(s), count=1)
                step += 1
            if short:
                acc, _ = _merge(acc, acc, x_smem, x_bar, xc, HALF, mma, False)
                xc += 1
            if HALF == 0:
                _down_store(acc, pair, row_ok, weights, y, stride_y, pid_n, mma)
            elif short.to(gl.int32) == 0:
                _down_store(acc, pair, row_ok, weights, y, stride_y, pid_n, mma)


@gluon.jit
def _down_step(a, b, p, acc, scale):
    tok = warpgroup_mma(a, b.permute((1, 0)), p, use_acc=False, is_async=True)
    p = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
    return acc + p * scale[:, None], p


@gluon.jit
def _down_store(acc, pair, row_ok, weights, y, stride_y, pid_n, mma: gl.constexpr):
    BN: gl.constexpr = acc.shape[1]
    w = gl.load(weights + gl.where(row_ok, pair, 0), mask=row_ok, other=0.0).to(gl.float32)
    out = (acc.to(gl.bfloat16).to(gl.float32) * w[:, None]).to(y.dtype.element_ty)
    cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    gl.store(y + pair.to(gl.int64)[:, None] * stride_y + cols[None, :], out, mask=row_ok[:, None])


@gluon.jit
def _down_top(a_smem, b_smem, ready, empty, x_smem, x_bar, a_s, stride_as, ws, stride_se, stride_sn, weights, y, stride_y,
              sorted_ids, expert_ids, num_post, num_valid, n_k, n_n, GROUP_M: gl.constexpr):
    _down_half(a_smem, b_smem, ready, empty, x_smem, x_bar, a_s, stride_as, ws, stride_se, stride_sn, weights, y, stride_y,
               sorted_ids, expert_ids, num_post, num_valid, n_k, n_n, 0, GROUP_M)


@gluon.jit
def _down_bottom(a_smem, b_smem, ready, empty, x_smem, x_bar, a_s, stride_as, ws, stride_se, stride_sn, weights, y, stride_y,
                 sorted_ids, expert_ids, num_post, num_valid, n_k, n_n, GROUP_M: gl.constexpr):
    _down_half(a_smem, b_smem, ready, empty, x_smem, x_bar, a_s, stride_as, ws, stride_se, stride_sn, weights, y, stride_y,
               sorted_ids, expert_ids, num_post, num_valid, n_k, n_n, 1, GROUP_M)


@gluon.jit
def ws_down_kernel(a_desc, a_s, stride_as, w_desc, ws, stride_se, stride_sn, weights, y, stride_y, sorted_ids,
                   expert_ids, num_post, num_valid, H, n_k, n_n, GROUP_M: gl.constexpr, S: gl.constexpr,
                   num_warps: gl.constexpr):
    """y[pair] <- weight[pair] * (a[row] . w2[e]) for 128-row tiles (the alignment blocks) by 128
    columns; a (float8, rows in block order) through `a_desc` with its group scales a_s, w2
    through `w_desc` (`[E * H, I]`, block `[128, 128]`), its block scales ws `[E, H / 128, I / 128]`."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [S, BM, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [S, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    x_smem = gl.allocate_shared_memory(gl.float32, [1, BM // 2, BN], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    x_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(x_bar, count=1)
    fence_async_shared()
    mma_args = (a_smem, b_smem, ready, empty, x_smem, x_bar, a_s, stride_as, ws, stride_se, stride_sn, weights, y, stride_y,
                sorted_ids, expert_ids, num_post, num_valid, n_k, n_n, GROUP_M)
    load_args = (a_desc, w_desc, sorted_ids, expert_ids, num_post, a_smem, b_smem, ready, empty, num_valid, H, n_k,
                 n_n, GROUP_M)
    gl.warp_specialize([(_down_top, mma_args), (_down_bottom, mma_args), (_down_loader, load_args)],
                       [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------- launchers


def _desc(t2d, block):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return TensorDescriptor(t2d, list(t2d.shape), list(t2d.stride()), block, layout)


def launch_ws_up(xq, xs, w13, s13, iq, is_, blocks, top_k: int, programs: int, stages: int = 4,
                 group_m: int = 8) -> None:
    """iq, is_ <- the intermediate of every pair of `blocks`, quantized (`ws_up_kernel`)."""
    E, N2, K = w13.shape
    n_n = N2 // 2 // 128
    tiles = blocks.expert_ids.numel() * n_n
    ws_up_kernel[(min(programs, tiles),)](
        xq, xq.stride(0), xs, xs.stride(0), _desc(w13.view(E * N2, K), [64, 128]), s13, s13.stride(0),
        s13.stride(1), iq, iq.stride(0), is_, is_.stride(0), blocks.sorted_ids, blocks.expert_ids, blocks.num_post,
        xq.shape[0] * top_k, N2 // 2, K, n_n, BM=blocks.block_m, TOP_K=top_k, GROUP_M=group_m,
        S=stages, num_warps=4)


def launch_ws_down(iq, is_, w2, s2, weights, y, blocks, programs: int, stages: int = 4, group_m: int = 8) -> None:
    """y <- each pair's routing weight times its row of iq . w2 (`ws_down_kernel`)."""
    E, H, I = w2.shape
    n_n = H // 128
    tiles = blocks.expert_ids.numel() * n_n
    ws_down_kernel[(min(programs, tiles),)](
        _desc(iq, [blocks.block_m, 128]), is_, is_.stride(0), _desc(w2.view(E * H, I), [128, 128]), s2,
        s2.stride(0), s2.stride(1), weights, y, y.stride(0), blocks.sorted_ids, blocks.expert_ids, blocks.num_post,
        weights.numel(), H, I // 128, n_n, GROUP_M=group_m, S=stages, num_warps=4)
