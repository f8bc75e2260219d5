"""A standalone W8A8 grouped up GEMM at the 30B's prefill size (2,048 tokens, uniform routing), its
K loop in variants: MODE 0 two block-scaled dots a step (the op's scheme), 1 one dot over gate and
up together, 2 no scaling at all (the ceiling without the waits), 3 each tile's columns in two
halves in turn. `python bench/w8a8_up_harness.py` on a Hopper GPU."""
import sys, math, os
import torch
import triton
import triton.language as tl

@triton.jit
def up_kernel(x, xs, w, ws, out, sorted_ids, expert_ids, N, K, n_tiles_n,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TOPK: tl.constexpr, MODE: tl.constexpr,
              GROUP_M: tl.constexpr, GATHER: tl.constexpr = True):
    pid = tl.program_id(0)
    num_pid_m = tl.num_programs(0) // n_tiles_n
    in_group = GROUP_M * n_tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    e = tl.load(expert_ids + (pid_m * BM) // 128).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ids + rows)
    tok = (pair // TOPK).to(tl.int64)
    if not GATHER:
        tok = (rows % 2048).to(tl.int64)
    offs_k = tl.arange(0, BK)
    n_k = K // BK
    a_ptrs = x + tok[:, None] * K + offs_k[None, :]
    as_rows = xs + tok * n_k
    sw_e = ws + e * (2 * N // 128) * n_k
    if MODE == 1:
        j = tl.arange(0, 2 * BN)
        wrow = tl.where(j < BN, pid_n * BN + j, N + pid_n * BN + j - BN).to(tl.int64)
        w_ptrs = w + e * 2 * N * K + wrow[None, :] * K + offs_k[:, None]
        acc = tl.zeros([BM, 2 * BN], dtype=tl.float32)
        for k in range(n_k):
            a = tl.load(a_ptrs)
            b = tl.load(w_ptrs)
            sa = tl.load(as_rows + k)
            sg = tl.load(sw_e + (pid_n * BN // 128) * n_k + k)
            su = tl.load(sw_e + ((N + pid_n * BN) // 128) * n_k + k)
            sw = tl.where(j < BN, sg, su)
            acc += tl.dot(a, b) * (sa[:, None] * sw[None, :])
            a_ptrs += BK
            w_ptrs += BK
        g, u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
    elif MODE == 3:
        # two BN/2 halves in turn, the first kept (bf16) for a 128-wide group's max
        HB: tl.constexpr = BN // 2
        o0 = tl.zeros([BM, HB], dtype=tl.bfloat16)
        for h in tl.static_range(2):
            a_ptrs = x + tok[:, None] * K + offs_k[None, :]
            offs_h = pid_n * BN + h * HB + tl.arange(0, HB)
            g_ptrs = w + e * 2 * N * K + offs_h[None, :].to(tl.int64) * K + offs_k[:, None]
            u_ptrs = g_ptrs + N * K
            g = tl.zeros([BM, HB], dtype=tl.float32)
            u = tl.zeros([BM, HB], dtype=tl.float32)
            for k in range(n_k):
                a = tl.load(a_ptrs)
                bg = tl.load(g_ptrs)
                bu = tl.load(u_ptrs)
                sa = tl.load(as_rows + k)
                sg = tl.load(sw_e + (pid_n * BN // 128) * n_k + k)
                su = tl.load(sw_e + ((N + pid_n * BN) // 128) * n_k + k)
                g += tl.dot(a, bg) * (sa * sg)[:, None]
                u += tl.dot(a, bu) * (sa * su)[:, None]
                a_ptrs += BK
                g_ptrs += BK
                u_ptrs += BK
            oh = ((g / (1.0 + tl.exp(-g))) * u).to(tl.bfloat16)
            if h == 0:
                o0 = oh
        amax = tl.maximum(tl.max(tl.abs(o0.to(tl.float32)), axis=1), tl.max(tl.abs(oh.to(tl.float32)), axis=1))
        sc = tl.maximum(amax, 1e-10) / 448.0
        offs0 = pid_n * BN + tl.arange(0, HB)
        tl.store(out + rows.to(tl.int64)[:, None] * N + offs0[None, :], (o0.to(tl.float32) / sc[:, None] * sc[:, None]).to(tl.bfloat16))
        tl.store(out + rows.to(tl.int64)[:, None] * N + HB + offs0[None, :], (oh.to(tl.float32) / sc[:, None] * sc[:, None]).to(tl.bfloat16))
    else:
        offs_n = pid_n * BN + tl.arange(0, BN)
        g_ptrs = w + e * 2 * N * K + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
        u_ptrs = g_ptrs + N * K
        g = tl.zeros([BM, BN], dtype=tl.float32)
        u = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(n_k):
            a = tl.load(a_ptrs)
            bg = tl.load(g_ptrs)
            bu = tl.load(u_ptrs)
            sa = tl.load(as_rows + k)
            sg = tl.load(sw_e + (pid_n * BN // 128) * n_k + k)
            su = tl.load(sw_e + ((N + pid_n * BN) // 128) * n_k + k)
            if MODE == 2:
                g = tl.dot(a, bg, g)
                u = tl.dot(a, bu, u)
            else:
                g += tl.dot(a, bg) * (sa * sg)[:, None]
                u += tl.dot(a, bu) * (sa * su)[:, None]
            a_ptrs += BK
            g_ptrs += BK
            u_ptrs += BK
    if MODE != 3:
        o = (g / (1.0 + tl.exp(-g))) * u
        offs_n = pid_n * BN + tl.arange(0, BN)
        tl.store(out + rows.to(tl.int64)[:, None] * N + offs_n[None, :], o.to(tl.bfloat16))


def make(T=2048, E=128, N=768, K=2048, topk=8, dev="cuda"):
    torch.manual_seed(0)
    x = (torch.randn(T, K, device=dev) * 0.5).to(torch.float8_e4m3fn)
    xs = torch.rand(T, K // 128, device=dev) * 0.01 + 0.001
    w = (torch.randn(E, 2 * N, K, device=dev) * 0.5).to(torch.float8_e4m3fn)
    ws = torch.rand(E, 2 * N // 128, K // 128, device=dev) * 0.01 + 0.001
    # uniform routing: each expert gets T*topk/E pairs; block of 128 rows each
    per = T * topk // E
    pairs = torch.randperm(T * topk, device=dev).view(E, per)
    sorted_ids = pairs.reshape(-1).to(torch.int32)
    expert_ids = torch.arange(E, device=dev).repeat_interleave(per // 128).to(torch.int32)
    return x, xs, w, ws, sorted_ids, expert_ids


def run(mode, x, xs, w, ws, sorted_ids, expert_ids, BM=128, BN=128, warps=8, stages=3, N=768, K=2048, gather=True):
    M = sorted_ids.numel()
    out = torch.empty(M, N, device=x.device, dtype=torch.bfloat16)
    ntn = N // BN
    grid = (M // BM * ntn,)
    up_kernel[grid](x, xs, w, ws, out, sorted_ids, expert_ids, N, K, ntn, BM=BM, BN=BN, BK=128, TOPK=8,
                    MODE=mode, GROUP_M=8, GATHER=gather, num_warps=warps, num_stages=stages)
    return out


def ref(x, xs, w, ws, sorted_ids, expert_ids, N=768, K=2048):
    xd = x.float() * xs.repeat_interleave(128, 1)
    wd = w.float() * ws.repeat_interleave(128, 1).repeat_interleave(128, 2)
    tok = (sorted_ids // 8).long()
    e_of_row = expert_ids.repeat_interleave(128).long()
    out = torch.empty(sorted_ids.numel(), N, device=x.device)
    for e in range(w.shape[0]):
        r = (e_of_row == e).nonzero().squeeze(1)
        h = xd[tok[r]] @ wd[e].T
        out[r] = torch.nn.functional.silu(h[:, :N]) * h[:, N:]
    return out


if __name__ == "__main__":
    args = make()
    r = ref(*args)
    flops = 2 * 2048 * 8 * 2 * 768 * 2048
    for mode, gather in ((0, True), (1, True), (2, True), (0, False), (2, False)):
        for warps, stages in ((8, 3), (8, 4), (4, 3)):
            try:
                o = run(mode, *args, warps=warps, stages=stages, gather=gather)
                torch.cuda.synchronize()
            except Exception as e:
                print(mode, warps, stages, "fail", str(e)[:200]); continue
            err = ((o.float() - r).abs().max() / r.abs().max()).item()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(10):
                    run(mode, *args, warps=warps, stages=stages, gather=gather)
            g.replay(); torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                s, t = torch.cuda.Event(True), torch.cuda.Event(True)
                s.record(); g.replay(); t.record(); t.synchronize()
                ts.append(s.elapsed_time(t) / 10 * 1000)
            us = min(ts)
            print(f"mode {mode} gather {gather} warps {warps} stages {stages}: {us:.1f} us  {flops / us / 1e6:.0f} TFLOP/s  relerr {err:.2e}", flush=True)
