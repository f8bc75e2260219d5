"""The Hopper warp-specialized W8A8 MoE GEMMs (compiled/moe/ws_kernels.py) against the op's Triton
kernels at 2,048 / 4,096 tokens: the quantized intermediate and the outputs compared, each timed
(CUDA graph over 8 layers of dummy FP8 experts). `python bench/ws_moe_check.py 2048 4096` on an H200."""
import sys, os
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch
from compiled.moe import fused_moe as fm, tuned_configs as tc, ws_kernels as W
from tune_moe import make_fp8_weights, make_routing, time_graph

E, H, I, K8 = 128, 2048, 768, 8


def run(T, L=8, sweep=True):
    w13s, w2s, scs = make_fp8_weights(L, E, H, I)
    _, routes = make_routing(1, T, E, K8)
    wts, ids = routes[0]
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ws = fm.MoEWorkspace()
    up, down = tc.split_config(tc.get_config(T, E, I, torch.bfloat16, torch.device("cuda"), fp8=True))
    print("T", T, "up", up, "down", down, flush=True)
    blocks = fm.moe_align_block_size(ids, E, up["BLOCK_SIZE_M"], ws)
    assert blocks.block_m == 128
    rows = blocks.expert_ids.numel() * 128
    inter = torch.empty(rows, I, device="cuda", dtype=torch.bfloat16)
    xq, xs = fm.quantized(ws, "x", x, 128)
    iq_t = torch.zeros(rows, I, device="cuda", dtype=torch.float8_e4m3fn); is_t = torch.zeros(rows, I // 128, device="cuda")
    iq_w = torch.zeros_like(iq_t); is_w = torch.zeros_like(is_t)
    weights = wts.reshape(-1).float().contiguous() if wts.dtype != torch.float32 else wts.reshape(-1).contiguous()
    y_t = torch.zeros(T * K8, H, device="cuda", dtype=torch.bfloat16); y_w = torch.zeros_like(y_t)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fm.launch_w8a8_gemm1(xq, xs, w13s[0], inter, (iq_t, is_t, 128), blocks, K8, up, scs[0])
    W.launch_ws_up(xq, xs, w13s[0], scs[0].w13, iq_w, is_w, blocks, K8, sms)
    torch.cuda.synchronize()
    n_post = int(blocks.num_post.item())
    live = (blocks.sorted_ids[:n_post] < T * K8).nonzero().squeeze(1)
    sid = blocks.sorted_ids[:n_post].view(-1, 128)
    print(f"blocks {n_post // 128}, short (<= 64 rows) {(sid[:, 64] >= T * K8).sum().item()}", flush=True)
    dq = lambda q, s: q[live].float() * s[live].repeat_interleave(128, dim=1)
    a, b = dq(iq_t, is_t), dq(iq_w, is_w)
    print(f"up: live rows {live.numel()}  max|diff| {(a - b).abs().max().item():.3e}  max|a| {a.abs().max().item():.3e}  "
          f"bytes differing {(iq_t[live].view(torch.uint8) != iq_w[live].view(torch.uint8)).float().mean().item():.2e} "
          f"scale rel {((is_t[live] - is_w[live]).abs() / is_t[live]).max().item():.2e}", flush=True)
    fm.launch_gemm2(iq_t, w2s[0], y_t, weights, blocks, down, K8, scales=scs[0], a_scale=is_t)
    W.launch_ws_down(iq_t, is_t, w2s[0], scs[0].w2, weights, y_w, blocks, sms)
    torch.cuda.synchronize()
    d = (y_t.float() - y_w.float()).abs().max().item()
    print(f"down: max|diff| {d:.3e}  max|y| {y_t.float().abs().max().item():.3e} nan {torch.isnan(y_w).any().item()}", flush=True)
    tri_up = time_graph([lambda l=l: fm.launch_w8a8_gemm1(xq, xs, w13s[l], inter, (iq_t, is_t, 128), blocks, K8, up, scs[l]) for l in range(L)]) / L
    tri_dn = time_graph([lambda l=l: fm.launch_gemm2(iq_t, w2s[l], y_t, weights, blocks, down, K8, scales=scs[l], a_scale=is_t) for l in range(L)]) / L
    print(f"triton up {tri_up:.1f} us  down {tri_dn:.1f} us", flush=True)
    for S in ((4, 5) if sweep else (4,)):
        for progs in (sms,):
            us = time_graph([lambda l=l: W.launch_ws_up(xq, xs, w13s[l], scs[l].w13, iq_w, is_w, blocks, K8, progs, S, 8) for l in range(L)]) / L
            print(f"ws up S {S} programs {min(progs, 10**4)}: {us:.1f} us", flush=True)
    for S in ((4, 6) if sweep else (4,)):
        for progs in (sms,):
            us = time_graph([lambda l=l: W.launch_ws_down(iq_t, is_t, w2s[l], scs[l].w2, weights, y_w, blocks, progs, S, 8) for l in range(L)]) / L
            print(f"ws down S {S} programs {min(progs, 10**4)}: {us:.1f} us", flush=True)


if __name__ == "__main__":
    for T in map(int, sys.argv[1:] or ["2048"]):
        run(T, sweep=T == 2048)
