"""The up GEMM of `w8a8_up_harness.py` in Gluon: gate and up dots issued in turn, each waiting for
the other's previous wgmma only (wait 1), so that a step's block scaling overlaps the next MMA.
`python bench/w8a8_up_gluon.py` on a Hopper GPU (Triton with Gluon); times it beside the Triton variants."""
import sys
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                               warpgroup_mma_init, warpgroup_mma_wait)


@gluon.jit
def up_w8a8(x, xs, w, ws, out, sorted_ids, expert_ids, N, K, n_tiles_n, num_valid,
            BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, BLOCK: gl.constexpr, TOPK: gl.constexpr,
            GROUP_M: gl.constexpr, S: gl.constexpr, WN: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    num_pid_m = gl.num_programs(0) // n_tiles_n
    in_group = GROUP_M * n_tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    e = gl.load(expert_ids + (pid_m * BM) // BLOCK).to(gl.int64)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps // WN, WN], instr_shape=[16, BN // WN, 32])
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
    b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv)
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [S, BM, BK], a_sl)
    g_smem = gl.allocate_shared_memory(gl.float8e4nv, [S, BN, BK], b_sl)
    u_smem = gl.allocate_shared_memory(gl.float8e4nv, [S, BN, BK], b_sl)

    rows_ld = gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
    k_ld = gl.arange(0, BK, layout=gl.SliceLayout(0, ld))
    pair = gl.load(sorted_ids + pid_m * BM + rows_ld)
    tok = gl.where(pair < num_valid, pair // TOPK, 0).to(gl.int64)
    a_ptrs = x + tok[:, None] * K + k_ld[None, :]
    n_ld = gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
    g_ptrs = w + e * 2 * N * K + (pid_n * BN + n_ld).to(gl.int64)[:, None] * K + k_ld[None, :]
    u_ptrs = g_ptrs + N * K
    n_k = K // BK
    for i in gl.static_range(S - 2):
        async_copy.async_copy_global_to_shared(a_smem.index(i), a_ptrs + i * BK)
        async_copy.async_copy_global_to_shared(g_smem.index(i), g_ptrs + i * BK)
        async_copy.async_copy_global_to_shared(u_smem.index(i), u_ptrs + i * BK)
        async_copy.commit_group()

    rows_m = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    pair_m = gl.load(sorted_ids + pid_m * BM + rows_m)
    tok_m = gl.where(pair_m < num_valid, pair_m // TOPK, 0).to(gl.int64)
    as_rows = xs + tok_m * n_k
    s_e = ws + e * (2 * N // 128) * n_k
    sg_base = s_e + ((pid_n * BN) // 128) * n_k
    su_base = s_e + ((N + pid_n * BN) // 128) * n_k

    acc_g = gl.zeros([BM, BN], gl.float32, mma)
    acc_u = gl.zeros([BM, BN], gl.float32, mma)
    tg_t = gl.zeros([BM, BN], gl.float32, mma)
    tu = warpgroup_mma_init(gl.zeros([BM, BN], gl.float32, mma))
    su_prev = gl.zeros([BM], gl.float32, gl.SliceLayout(1, mma))
    for k in range(n_k):
        s = k % S
        async_copy.wait_group(S - 3)
        fence_async_shared()
        gl.thread_barrier()
        j = gl.minimum(k + S - 2, n_k - 1)
        js = (k + S - 2) % S
        async_copy.async_copy_global_to_shared(a_smem.index(js), a_ptrs + j * BK)
        async_copy.async_copy_global_to_shared(g_smem.index(js), g_ptrs + j * BK)
        async_copy.async_copy_global_to_shared(u_smem.index(js), u_ptrs + j * BK)
        async_copy.commit_group()
        sa = gl.load(as_rows + k)
        sg = gl.load(sg_base + k)
        su = gl.load(su_base + k)
        a_s = a_smem.index(s)
        tg = warpgroup_mma(a_s, g_smem.index(s).permute((1, 0)), tg_t, use_acc=False, is_async=True)
        tu_t = warpgroup_mma_wait(num_outstanding=1, deps=(tu,))
        acc_u = acc_u + tu_t * su_prev[:, None]
        tu = warpgroup_mma(a_s, u_smem.index(s).permute((1, 0)), tu_t, use_acc=False, is_async=True)
        tg_t = warpgroup_mma_wait(num_outstanding=1, deps=(tg,))
        acc_g = acc_g + tg_t * (sa * sg)[:, None]
        su_prev = sa * su
    tu_t = warpgroup_mma_wait(num_outstanding=0, deps=(tu,))
    acc_u = acc_u + tu_t * su_prev[:, None]
    async_copy.wait_group(0)

    g = acc_g.to(gl.bfloat16).to(gl.float32)
    u = acc_u.to(gl.bfloat16).to(gl.float32)
    act = (g / (1.0 + gl.exp(-g))).to(gl.bfloat16).to(gl.float32)
    o = (act * u).to(gl.bfloat16)
    cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    gl.store(out + (pid_m * BM + rows_m).to(gl.int64)[:, None] * N + cols[None, :], o)


def run(x, xs, w, ws, sorted_ids, expert_ids, BM=64, BN=128, S=4, warps=8, WN=2, N=768, K=2048):
    M = sorted_ids.numel()
    out = torch.empty(M, N, device=x.device, dtype=torch.bfloat16)
    ntn = N // BN
    up_w8a8[(M // BM * ntn,)](x, xs, w, ws, out, sorted_ids, expert_ids, N, K, ntn, M, BM=BM, BN=BN, BK=128,
                              BLOCK=128, TOPK=8, GROUP_M=8, S=S, WN=WN, num_warps=warps)
    return out


if __name__ == "__main__":
    import w8a8_up_harness as h
    args = h.make()
    r = h.ref(*args)
    flops = 2 * 2048 * 8 * 2 * 768 * 2048

    def bench(fn):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(10):
                fn()
        g.replay(); torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            s, t = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record(); g.replay(); t.record(); t.synchronize()
            ts.append(s.elapsed_time(t) / 10 * 1000)
        return min(ts)

    for mode, BM, BN, warps, st in ((0, 128, 64, 8, 4), (3, 128, 128, 8, 4), (3, 128, 128, 8, 3), (3, 128, 128, 4, 4),
                                    (0, 64, 128, 4, 4), (0, 64, 128, 8, 4), (0, 64, 64, 4, 4), (0, 128, 128, 8, 3)):
        o = h.run(mode, *args, BM=BM, BN=BN, warps=warps, stages=st)
        err = ((o.float() - r).abs().max() / r.abs().max()).item()
        us = bench(lambda: h.run(mode, *args, BM=BM, BN=BN, warps=warps, stages=st))
        print(f"triton mode {mode} BM {BM} BN {BN} warps {warps} stages {st}: {us:.1f} us  {flops / us / 1e6:.0f} TFLOP/s err {err:.1e}", flush=True)
