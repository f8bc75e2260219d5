"""Fused MoE and routing kernels against their torch references.

CPU: the Triton kernels run under TRITON_INTERPRET=1 in two subprocesses (the variable must be set
before triton is imported, and other test modules import it first); each case below is one test.
GPU (`-m gpu`): the real Qwen3-30B-A3B layer shape in bf16, CUDA-graph capture, no host syncs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from compiled.moe import fused_moe as fm  # noqa: E402  (no triton kernels are defined by this import)
from compiled.moe import tuned_configs  # noqa: E402
from compiled.moe.routing import topk_route_ref  # noqa: E402
from tests.conftest import (assert_bf16_within_reference, capture_without_host_sync, child_env, rank_routing,  # noqa: E402
                            run_cases)

MARK = "@@MOE_CASES@@"


def _cfg(bm, bn, bk, group=1):
    return dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=group, num_warps=4, num_stages=2)


def _problem(T, E, k, H, I, dtype=torch.float32, seed=0, used_experts=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    logits = torch.randn(T, E, generator=g)
    if used_experts is not None:  # the other experts receive no tokens
        logits[:, used_experts:] -= 1e4
    w, ids = topk_route_ref(logits, k, True)
    to = dict(device=device)
    return x.to(dtype=dtype, **to), w.to(**to), ids.to(**to), w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to)


def _check_fused(T, E, k, H, I, cfg, dtype=torch.float32, used_experts=None, seed=0):
    x, w, ids, w13, w2 = _problem(T, E, k, H, I, dtype, seed, used_experts)
    out = fm.fused_moe_triton(x, w, ids, w13, w2, config=cfg)
    assert out.shape == x.shape and out.dtype == x.dtype
    exact = fm.fused_moe_ref(x.float(), w, ids, w13.float(), w2.float())
    if dtype == torch.float32:
        torch.testing.assert_close(out, exact, atol=2e-5, rtol=1e-5)
    else:
        # the reference in the low dtype sets the scale of rounding error (the CPU interpreter
        # truncates fp32->bf16 casts, biased errors that add up over the epilogue casts, so bf16
        # gets a wide margin here; the GPU tests check bf16 tightly)
        ref = fm.fused_moe_ref(x, w, ids, w13, w2)
        ref_err = (ref.float() - exact).abs().max().item()
        err = (out.float() - exact).abs().max().item()
        slack = 8.0 if dtype == torch.bfloat16 else 2.0
        assert err <= slack * ref_err + 1e-3, (err, ref_err)


def check_routed_ops(x, x_moe, logits, w13, w2, nw, weight, renorm: bool, tol: float) -> None:
    """fused_moe and moe_add_rms_norm_linear given the router's logits (top-2) against their
    references on the routing op's reference of them."""
    from compiled.fusions.moe_norm_linear import moe_add_rms_norm_linear_ref
    w, ids = topk_route_ref(logits, 2, renorm)
    out = torch.ops.compiled.fused_moe(x_moe, None, None, w13, w2, router_logits=logits, top_k=2, renormalize=renorm)
    torch.testing.assert_close(out, fm.fused_moe_ref(x_moe, w, ids, w13, w2), atol=max(tol, 2e-5), rtol=max(tol, 1e-5))
    got = torch.ops.compiled.moe_add_rms_norm_linear(x, x_moe, None, None, w13, w2, nw, 1e-6, weight, True,
                                                     router_logits=logits, top_k=2, renormalize=renorm)
    for a, b in zip(got, moe_add_rms_norm_linear_ref(x, x_moe, w, ids, w13, w2, nw, 1e-6, weight)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- interpreter cases

def case_two_tokens_e128_k8_default_config():
    # the fewest tokens the grouped GEMMs take (one token runs the GEMVs)
    x, w, ids, w13, w2 = _problem(2, 128, 8, 32, 48)
    out = fm.fused_moe_triton(x, w, ids, w13, w2, config=tuned_configs.default_config(2, 128))
    torch.testing.assert_close(out, fm.fused_moe_ref(x, w, ids, w13, w2), atol=2e-5, rtol=1e-5)


def case_one_token_gemv_odd_sizes_slots_and_sum():
    # one token as two GEMVs: H and I not multiples of the tiles, top-1 to top-8, summed (by the
    # sum kernel) and unsummed (each slot's weighted expert output), fp32 and bf16, the default
    # tiles too; K loops of several tiles pipelined (num_stages) too
    tiles = dict(up=dict(BLOCK_N=2, BLOCK_K=16, num_warps=4), down=dict(BLOCK_N=4, BLOCK_K=32, num_warps=4))
    staged = dict(up=dict(tiles["up"], num_stages=3), down=dict(tiles["down"], BLOCK_K=16, num_stages=2))
    for E, k, H, I, seed in ((128, 8, 40, 24, 5), (8, 1, 33, 48, 6), (60, 6, 64, 17, 7)):
        x, w, ids, w13, w2 = _problem(1, E, k, H, I, seed=seed)
        ref = fm.fused_moe_ref(x, w, ids, w13, w2)
        for t in (tiles, staged):
            out = fm.fused_moe_triton(x, w, ids, w13, w2, gemv_tiles=t)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
        if k > 1:
            slots = fm.fused_moe_triton(x, w, ids, w13, w2, gemv_tiles=tiles, sum_slots=False)
            assert slots.shape == (k, H)
            torch.testing.assert_close(slots.sum(0, keepdim=True), ref, atol=2e-5, rtol=1e-5)
    x, w, ids, w13, w2 = _problem(1, 16, 4, 48, 32, dtype=torch.bfloat16, seed=8)
    exact = fm.fused_moe_ref(x.float(), w, ids, w13.float(), w2.float())
    ref_err = (fm.fused_moe_ref(x, w, ids, w13, w2).float() - exact).abs().max().item()
    for t in (tiles, None):
        out = fm.fused_moe_triton(x, w, ids, w13, w2, gemv_tiles=t)
        assert (out.float() - exact).abs().max().item() <= 8.0 * ref_err + 1e-3


def case_t300_e8_k2_two_k_steps_grouped_half_and_quarter_tiles():
    # 66-84 pairs per expert: one full 64-row block, then a partial block of 2-20 rows, run as a
    # 16-row tile (5 experts) or a 32-row tile (3 experts); the up GEMM may only halve once
    cfg = dict(_cfg(64, 32, 16, group=4), HALF_M=1, down=dict(BLOCK_SIZE_N=32, HALF_M=2))
    _check_fused(300, 8, 2, 32, 48, cfg, seed=1)
    _check_fused(300, 8, 2, 32, 48, dict(cfg, HALF_M=2), seed=1)
    assert tuned_configs.split_config(dict(_cfg(32, 32, 16), HALF_M=2))[0]["HALF_M"] == 1  # no tile under 16 rows


def case_t300_e8_k2_down_tiles_under_the_blocks():
    # down tiles of half (a quarter of) the 64-row blocks: a full block runs as two (four) in one
    # program, a partial one's tiles past its pairs (all padding) are skipped, one holding a few
    # pairs runs half height; through TMA for the intermediate's full tiles too (bf16)
    cfg = dict(_cfg(64, 32, 16, group=4), HALF_M=1, down=dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=32, HALF_M=1))
    _check_fused(300, 8, 2, 32, 48, cfg, seed=1)
    _check_fused(300, 8, 2, 32, 48, dict(cfg, down=dict(BLOCK_SIZE_M=16, GROUP_SIZE_M=3)), seed=2)
    _check_fused(300, 8, 2, 32, 48, dict(cfg, TMA=1, down=dict(BLOCK_SIZE_M=32, TMA=1)), dtype=torch.bfloat16,
                 seed=3)
    assert tuned_configs.split_config(dict(cfg, down=dict(BLOCK_SIZE_M=16, HALF_M=2)))[1]["HALF_M"] == 0


def case_t150_e8_k2_half_tiles_up_only():
    cfg = dict(_cfg(32, 64, 32), HALF_M=1, down=dict(HALF_M=0))
    _check_fused(150, 8, 2, 32, 48, cfg, seed=17)


def case_t37_e128_k8_unused_experts_fp16():
    _check_fused(37, 128, 8, 32, 48, _cfg(16, 64, 32), dtype=torch.float16, used_experts=20, seed=2)


def case_t5_e60_k6_uneven_k_and_n():
    _check_fused(5, 60, 6, 40, 24, _cfg(16, 32, 32), seed=3)


def case_t128_e16_k1_no_sum():
    _check_fused(128, 16, 1, 32, 48, _cfg(32, 64, 32), seed=4)


def case_t61_e33_k3_bf16():
    _check_fused(61, 33, 3, 32, 48, _cfg(32, 32, 32, group=8), dtype=torch.bfloat16, seed=5)


def case_tma_weight_tiles_bf16_n_and_k_tails():
    # TMA weight tiles: I = 48 is not a multiple of BLOCK_N = 32 (the last gate tile reads up rows,
    # the last up tile the next expert's rows or zeros past the end) nor of gemm2's BLOCK_K = 32
    cfg = dict(_cfg(32, 32, 32, group=8), HALF_M=1, TMA=1)
    x, *_, w13, w2 = _problem(61, 33, 3, 32, 48, torch.bfloat16, seed=5)
    assert fm.weight_desc(w13, 32, 32) is not None and fm.weight_desc(w2, 32, 32) is not None
    assert fm.weight_desc(w13.float(), 32, 32) is None  # fp32 weights keep pointer loads
    _check_fused(61, 33, 3, 32, 48, cfg, dtype=torch.bfloat16, seed=5)


def case_tma_intermediate_tiles_full_blocks_bf16():
    # 66-84 pairs per expert: full 32-row blocks, whose rows of the intermediate gemm2 reads through
    # TMA (K = 48: the tail tile reads zeros past the last column), then partial blocks by pointers
    cfg = dict(_cfg(32, 32, 32, group=4), HALF_M=1, TMA=1)
    _check_fused(300, 8, 2, 32, 48, cfg, dtype=torch.bfloat16, seed=11)


def case_tma_up_only_fp16_half_tiles():
    cfg = dict(_cfg(64, 64, 16, group=4), HALF_M=1, TMA=1, down=dict(BLOCK_SIZE_N=32, TMA=0))
    _check_fused(300, 8, 2, 32, 48, cfg, dtype=torch.float16, seed=9)


def case_t2_e8_k8_all_experts_down_override():
    cfg = dict(_cfg(16, 64, 32), down=dict(BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, GROUP_SIZE_M=2))
    _check_fused(2, 8, 8, 32, 48, cfg, seed=6)


def case_op_dispatch_and_workspace():
    x, w, ids, w13, w2 = _problem(9, 8, 2, 32, 48, seed=7)
    before = fm.BACKEND.name
    fm.BACKEND.set("triton")
    try:
        out = torch.ops.compiled.fused_moe(x, w, ids, w13, w2)
    finally:
        fm.BACKEND.set(before)
    torch.testing.assert_close(out, fm.fused_moe_ref(x, w, ids, w13, w2), atol=2e-5, rtol=1e-5)
    ws = fm.MoEWorkspace().reserve(40, 8, 32, 48, 2, torch.float32, x.device)
    before = {n: b.data_ptr() for n, b in ws.buffers.items()}
    for T, seed in ((40, 8), (3, 9), (17, 10)):
        x, w, ids, w13, w2 = _problem(T, 8, 2, 32, 48, seed=seed)
        out = fm.fused_moe_triton(x, w, ids, w13, w2, config=_cfg(16, 64, 32), workspace=ws)
        torch.testing.assert_close(out, fm.fused_moe_ref(x, w, ids, w13, w2), atol=2e-5, rtol=1e-5)
    assert {n: b.data_ptr() for n, b in ws.buffers.items()} == before, "workspace reallocated"


def _quant_buffers(T: int, H: int, group: int):
    from compiled.quant.act_quant import QuantizedRows
    return QuantizedRows(torch.empty(T, H, dtype=torch.float8_e4m3fn), torch.full((T, -(-H // group)), -1.0), group)


def _check_quantized(into, rows):
    """A kernel's quantized rows `into` against the reference's quantization of the rows it read
    or stored (`rows`)."""
    from compiled.quant.act_quant import quantize_per_token_group_ref
    rq, rs = quantize_per_token_group_ref(rows, into.group)
    assert ((into.s - rs).abs() / rs).max().item() <= 1e-6
    # a value rounded the other way across a tie is one e4m3 step (2^-3 relative, 2^-9 subnormal) off
    assert ((into.q.float() - rq.float()).abs() / (rq.float().abs() * 2 ** -3 + 2 ** -9)).max().item() <= 1.0


def case_sum_add_rms_norm_kernel_and_op():
    # the top-k sum + residual add + RMSNorm kernel against its reference (H not a power of two),
    # with normed also quantized for a W8A8 linear (a partial last group at H 33), and with fp32
    # rows added to the sum (the experts' LoRA down deltas), as the sum kernel alone adds them;
    # then the whole op through the Triton MoE against the two ops' references
    from compiled.fusions.moe_norm_linear import moe_add_rms_norm_linear_ref
    g = torch.Generator().manual_seed(18)
    for T, k, H, dtype, group, with_delta in ((1, 2, 40, torch.float32, 0, False),
                                              (23, 4, 33, torch.bfloat16, 16, True),
                                              (7, 8, 64, torch.float32, 32, True)):
        pairs, x = torch.randn(T * k, H, generator=g).to(dtype), torch.randn(T, H, generator=g).to(dtype)
        nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
        delta = 3 * torch.randn(T, H, generator=g) if with_delta else None
        into = _quant_buffers(T, H, group) if group else None
        h, normed = fm.moe_sum_add_rms_norm_triton(pairs, x, nw, 1e-6, quantize=into, delta=delta)
        ref_h, ref_normed = fm.moe_sum_add_rms_norm_ref(pairs, x, nw, 1e-6, delta=delta)
        tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(h, ref_h, **tol)
        torch.testing.assert_close(normed, ref_normed, **tol)
        if into is not None:
            _check_quantized(into, normed)
        if delta is not None:
            ids = torch.zeros(T, k, dtype=torch.int64)
            summed = x.new_empty(T, H)
            fm.launch_sum(pairs, ids, summed, delta=delta)
            want = (pairs.view(T, k, H).float().sum(1) + delta).to(dtype)
            torch.testing.assert_close(summed, want, **tol)
            assert (want.float() - pairs.view(T, k, H).float().sum(1)).abs().max() > 1   # the rows weigh in
    for T in (19, 1):   # the grouped GEMMs, and one token's GEMVs
        x_moe, w, ids, w13, w2 = _problem(T, 8, 2, 32, 48, seed=19)
        x = torch.randn(T, 32, generator=g)
        nw, weight = 1 + 0.1 * torch.randn(32, generator=g), torch.randn(24, 32, generator=g)
        before = fm.BACKEND.name
        fm.BACKEND.set("triton")
        try:
            y, h, normed = torch.ops.compiled.moe_add_rms_norm_linear(x, x_moe, w, ids, w13, w2, nw, 1e-6, weight,
                                                                      True)
        finally:
            fm.BACKEND.set(before)
        for got, ref in zip((y, h, normed), moe_add_rms_norm_linear_ref(x, x_moe, w, ids, w13, w2, nw, 1e-6, weight)):
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def case_sum_add_rms_norm_with_the_next_linears_shrink():
    # the norm's kernel also running the next linear's LoRA shrink of each normed row: H not a
    # power of two, outputs split over programs of 1 and 8 with a partial last one, slots -1 and
    # out of range (rows of zeros); h and normed as without it; with the rows quantized for a
    # W8A8 linear too (group 16, a partial last group at H 33, written once however the outputs split)
    from compiled.linear.lora import lora_shrink_ref
    g = torch.Generator().manual_seed(20)
    assert [fm.shrink_outputs_a_program(T) for T in (1, 5, 17)] == [1, 8, 8]
    for T, k, H, NR, S, dtype, slots in ((1, 8, 40, 3, 2, torch.float32, [1]),
                                         (5, 2, 40, 22, 3, torch.float32, [2, -1, 0, 7, 1]),
                                         (17, 8, 33, 20, 2, torch.bfloat16, [1, 0, -1] * 5 + [1, 1])):
        pairs, x = torch.randn(T * k, H, generator=g).to(dtype), torch.randn(T, H, generator=g).to(dtype)
        nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
        a = (torch.randn(S, NR, H, generator=g) / H ** 0.5).to(dtype)
        slot = torch.tensor(slots, dtype=torch.int32)
        into = _quant_buffers(T, H, 16)
        h, normed, s = fm.moe_sum_add_rms_norm_triton(pairs, x, nw, 1e-6, shrink=(a, slot), quantize=into)
        want_h, want_normed = fm.moe_sum_add_rms_norm_triton(pairs, x, nw, 1e-6)
        assert torch.equal(h, want_h) and torch.equal(normed, want_normed)
        _check_quantized(into, normed)
        torch.testing.assert_close(s, lora_shrink_ref(normed, a, slot), atol=1e-5, rtol=1e-5)
        has = (slot >= 0) & (slot < S)
        assert s.dtype == torch.float32 and bool((s[~has] == 0).all()) and bool((s[has] != 0).all())


def _check_align(T, k, E, block_m, used=None, seed=0, launch=None, quant=None):
    """`quant` (K, group): the launch also quantizes a random x `[T, K]`, checked against
    `quantize_per_token_group_ref` as tests/quant checks the standalone kernel."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if used is not None:
        logits[:, used:] -= 1e4
    ids = torch.topk(logits, k, dim=-1).indices
    xquant = None
    if quant is not None:
        K, group = quant
        x = torch.randn(T, K, generator=g) * (torch.rand(T, 1, generator=g) * 100 + 0.01)
        xquant = _quant_buffers(T, K, group)
    sorted_ids, expert_ids, num_post, _ = fm.moe_align_block_size(ids, E, block_m, launch=launch,
                                                                  quantize=None if xquant is None else (x, xquant))
    if xquant is not None:
        _check_quantized(xquant, x)
    numel = T * k
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum())
    assert int(num_post[0]) == total
    assert sorted_ids.numel() >= fm.max_padded_size(numel, E, block_m) >= total
    start = 0
    for e in range(E):
        seg = sorted_ids[start:start + int(padded[e])]
        n = int(counts[e])
        # each pair exactly once (chunks land in arrival order: compare as sets)
        assert torch.equal(seg[:n].sort().values, (flat == e).nonzero().flatten().to(torch.int32)), e
        assert bool((seg[n:] == numel).all()), e
        assert bool((expert_ids[start // block_m:(start + int(padded[e])) // block_m] == e).all()), e
        start += int(padded[e])
    assert bool((expert_ids[total // block_m:] == -1).all())
    for name in ("align_totals", "align_done"):  # put back to zero for the next call
        assert not fm.zeroed(ids.device, name, 1, torch.int32).any(), name


def case_align_multi_chunk_e128_k8():
    _check_align(150, 8, 128, 16, seed=11)
    _check_align(300, 8, 16, 32, seed=16)  # 75 chunks of 32 pairs
    _check_align(300, 8, 16, 32, seed=21, quant=(200, 64))   # and x quantized: 16 rows by one group a program
    assert fm.align_launch(2400, 16, 32).chunk == 32 and fm.align_launch(40000, 128, 128).chunk == 256


def case_align_counted_by_every_program_and_unused_experts():
    # up to COUNT_ALL_MAX_PAIRS pairs each program counts them all: 80 pairs in 3 programs, 40 in 2
    _check_align(10, 8, 128, 16, seed=17)
    _check_align(10, 4, 20, 32, used=6, seed=12)
    _check_align(16, 8, 128, 16, seed=18)
    _check_align(10, 8, 128, 16, seed=19, launch=fm.AlignLaunch(chunk=128, sub=32, bb=32))   # one program
    _check_align(1, 1, 8, 16, seed=13)
    _check_align(10, 8, 128, 16, seed=22, quant=(72, 32))   # one row by 3 groups a program, the last one partial
    _check_align(300, 1, 8, 64, seed=14)


def case_routing_kernel_vs_softmax_topk():
    from compiled.moe import routing
    from compiled.moe.routing import topk_route_triton
    g = torch.Generator().manual_seed(15)
    for T, E, k, dtype in ((1, 8, 2, torch.float32), (37, 128, 8, torch.bfloat16), (300, 60, 6, torch.float32),
                           (5, 8, 1, torch.float16)):
        logits = torch.randn(T, E, generator=g).to(dtype)
        for renorm in (True, False):
            probs = torch.softmax(logits.float(), dim=-1)
            top = torch.topk(probs, k, dim=-1)
            ref_w = top.values / top.values.sum(-1, keepdim=True) if renorm else top.values
            w, ids = topk_route_triton(logits, k, renorm)
            assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (T, k)
            torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
            # same experts up to ties: every chosen expert has the probability of that rank
            torch.testing.assert_close(probs.gather(1, ids), top.values, atol=0, rtol=0)
            assert bool((ids.sort(-1).values.diff(dim=-1) > 0).all()) if k > 1 else True
        before = routing.BACKEND.name
        routing.BACKEND.set("triton")
        try:
            w_op, _ = torch.ops.compiled.topk_route(logits, k, True)
        finally:
            routing.BACKEND.set(before)
        torch.testing.assert_close(w_op, topk_route_ref(logits, k, True)[0], atol=1e-6, rtol=1e-5)


def case_routing_kernel_keeps_the_ranks_experts():
    """local_experts: each rank's pairs (ids made local, the others id -1 with weight 0) are the
    whole routing's, mapped; the kernel matches the reference on every rank."""
    from compiled.moe.routing import topk_route_triton
    from compiled.parallel.tensor import TPGroup, set_tp_group
    g = torch.Generator().manual_seed(16)
    T, E, k, count = 37, 60, 6, 15
    logits = torch.randn(T, E, generator=g)
    whole_w, whole_ids = topk_route_triton(logits, k, True)
    seen = torch.zeros(T, k, dtype=torch.int64)
    for rank in range(E // count):
        set_tp_group(TPGroup(None, E // count, rank))
        try:
            w, ids = topk_route_triton(logits, k, True, local_experts=count)
            ref_w, ref_ids = topk_route_ref(logits, k, True, local_experts=count)
        finally:
            set_tp_group(None)
        mine = (whole_ids >= rank * count) & (whole_ids < (rank + 1) * count)
        torch.testing.assert_close(w, torch.where(mine, whole_w, 0.0), atol=1e-6, rtol=1e-5)
        assert torch.equal(ids, torch.where(mine, whole_ids - rank * count, -1))
        torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
        assert torch.equal(ids, ref_ids)
        seen += mine
    assert torch.equal(seen, torch.ones(T, k, dtype=torch.int64))   # every pair on exactly one rank


def case_other_ranks_pairs_are_skipped():
    # expert parallelism over 2 ranks of 4 experts: each rank's output (its experts' pairs only;
    # the others' ids -1) is the whole MoE with the other pairs at weight 0, and the ranks' outputs
    # add up to the whole MoE. Scratch and outputs start as NaN, so a row the kernels should have
    # left out, or should have written and did not, shows. One token's GEMVs (top-4, top-1), the
    # grouped GEMMs (top-3, top-1; 244 pairs: the alignment's count kernel), and the unsummed pairs
    # summed by the norm's kernel.
    tiles = dict(up=dict(BLOCK_N=2, BLOCK_K=16, num_warps=4), down=dict(BLOCK_N=4, BLOCK_K=16, num_warps=4))
    for T, k, seed in ((1, 4, 30), (1, 1, 31), (29, 3, 32), (17, 1, 33), (61, 4, 34)):
        x, w, ids, w13, w2 = _problem(T, 8, k, 40, 24, seed=seed)
        whole, total = fm.fused_moe_ref(x, w, ids, w13, w2), torch.zeros_like(x)
        for first in (0, 4):
            w_r, ids_r, mine = rank_routing(w, ids, first, 4)
            ws = fm.MoEWorkspace().reserve(T, 4, 40, 24, k, x.dtype, x.device)
            for buf in ws.buffers.values():
                buf.fill_(float("nan") if buf.is_floating_point() else 0)
            out = torch.full_like(x, float("nan"))
            fm.fused_moe_triton(x, w_r, ids_r, w13[first:first + 4], w2[first:first + 4], config=_cfg(16, 32, 16),
                                workspace=ws, out=out, gemv_tiles=tiles)
            want = fm.fused_moe_ref(x, torch.where(mine, w, 0.0), ids, w13, w2)
            torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(fm.fused_moe_ref(x, w_r, ids_r, w13[first:first + 4], w2[first:first + 4]),
                                       want, atol=2e-5, rtol=1e-5)
            total += out
            if k > 1:
                pairs = fm.fused_moe_triton(x, w_r, ids_r, w13[first:first + 4], w2[first:first + 4],
                                            config=_cfg(16, 32, 16), workspace=ws, gemv_tiles=tiles, sum_slots=False)
                nw = torch.rand(40) + 0.5
                got = fm.moe_sum_add_rms_norm_triton(pairs, x, nw, 1e-6, ids=ids_r)
                for g, r in zip(got, fm.moe_sum_add_rms_norm_ref(pairs, x, nw, 1e-6, ids=ids_r)):
                    torch.testing.assert_close(g, r, atol=2e-5, rtol=1e-5)
                torch.testing.assert_close(got[0], x + want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(total, whole, atol=2e-5, rtol=1e-5)


def case_routing_inside_the_experts_first_launch():
    # the experts op given the router's logits routes the tokens: inside the alignment's count
    # kernel (61 tokens of top-4: 244 pairs; 17 of top-2 on a rank), else by the routing kernel
    # before it (one token's GEMVs; the place kernel counting all pairs, 2 and 16 tokens of top-8;
    # top-3, whose pairs a chunk would split); renormalised or not, over all experts or a rank's
    # (local_experts). The buffers start as NaN / -7: each must hold the routing kernel's weights
    # and ids, and the output the reference's on them.
    from compiled.moe.routing import Router, Routed, routed_buffers, topk_route_triton
    from compiled.parallel.tensor import TPGroup, set_tp_group
    tiles = dict(up=dict(BLOCK_N=2, BLOCK_K=16, num_warps=4), down=dict(BLOCK_N=4, BLOCK_K=16, num_warps=4))
    g = torch.Generator().manual_seed(40)
    for T, E, k, renorm, local in ((1, 128, 8, True, None), (1, 8, 1, False, None), (2, 128, 8, True, None),
                                   (16, 128, 8, False, None), (61, 33, 4, True, None), (61, 33, 4, False, None),
                                   (29, 8, 3, True, None), (1, 8, 4, True, 4), (80, 8, 2, True, 4)):
        x, _, _, w13, w2 = _problem(T, E, k, 40, 24, seed=T + E)
        logits = torch.randn(T, E, generator=g)
        set_tp_group(TPGroup(None, 2, 1) if local else None)
        try:
            want_w, want_ids = topk_route_triton(logits, k, renorm, local)
            router = Router(logits, k, renorm, local)
            w, ids = routed_buffers(router)
            w.fill_(float("nan"))
            ids.fill_(-7)
            ex = slice(E - local, E) if local else slice(0, E)
            out = fm.fused_moe_triton(x, w, ids, w13[ex], w2[ex], config=_cfg(16, 32, 16), gemv_tiles=tiles,
                                      route=Routed(router, w, ids))
        finally:
            set_tp_group(None)
        assert torch.equal(ids, want_ids), (T, E, k)
        torch.testing.assert_close(w, want_w, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out, fm.fused_moe_ref(x, want_w, want_ids, w13[ex], w2[ex]), atol=2e-5, rtol=1e-5)
    # through the ops, and with the norm's kernel summing: the same as routed by the routing op
    before = fm.BACKEND.name
    fm.BACKEND.set("triton")
    try:
        for T in (1, 19):
            x_moe, _, _, w13, w2 = _problem(T, 8, 2, 32, 48, seed=41)
            logits, x = torch.randn(T, 8, generator=g), torch.randn(T, 32, generator=g)
            nw, weight = 1 + 0.1 * torch.randn(32, generator=g), torch.randn(24, 32, generator=g)
            check_routed_ops(x, x_moe, logits, w13, w2, nw, weight, True, 1e-4)
    finally:
        fm.BACKEND.set(before)


GROUPS = {
    "a": [case_two_tokens_e128_k8_default_config, case_one_token_gemv_odd_sizes_slots_and_sum,
          case_t300_e8_k2_two_k_steps_grouped_half_and_quarter_tiles,
          case_t150_e8_k2_half_tiles_up_only, case_t37_e128_k8_unused_experts_fp16, case_t5_e60_k6_uneven_k_and_n,
          case_routing_kernel_vs_softmax_topk, case_routing_kernel_keeps_the_ranks_experts,
          case_other_ranks_pairs_are_skipped, case_t300_e8_k2_down_tiles_under_the_blocks],
    "b": [case_t128_e16_k1_no_sum, case_t61_e33_k3_bf16, case_t2_e8_k8_all_experts_down_override,
          case_op_dispatch_and_workspace, case_align_multi_chunk_e128_k8, case_align_counted_by_every_program_and_unused_experts,
          case_tma_weight_tiles_bf16_n_and_k_tails, case_tma_intermediate_tiles_full_blocks_bf16,
          case_tma_up_only_fp16_half_tiles, case_sum_add_rms_norm_kernel_and_op,
          case_sum_add_rms_norm_with_the_next_linears_shrink, case_routing_inside_the_experts_first_launch],
}
CASE_NAMES = [f.__name__ for fns in GROUPS.values() for f in fns]


def _run_group(group: str) -> None:
    """Subprocess entry point: run one group under the interpreter, print results as JSON."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from compiled.moe import fused_moe_kernels
    assert type(fused_moe_kernels.moe_gemm1_kernel).__name__ == "InterpretedFunction"
    print(MARK + json.dumps(run_cases(GROUPS[group])))


@pytest.fixture(scope="module")
def interpreter_results():
    env = child_env(TRITON_INTERPRET="1", COMPILED_MOE_BACKEND=None, COMPILED_ROUTING_BACKEND=None)
    procs = {g: subprocess.Popen([sys.executable, __file__, g], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=str(REPO)) for g in GROUPS}
    results = {}
    for g, p in procs.items():
        out, err = p.communicate(timeout=600)
        lines = [line for line in out.splitlines() if line.startswith(MARK)]
        if not lines:
            for fn in GROUPS[g]:
                results[fn.__name__] = f"group {g} crashed (rc {p.returncode}):\n{err[-4000:]}"
            continue
        results.update(json.loads(lines[-1][len(MARK):]))
    return results


@pytest.mark.parametrize("case", CASE_NAMES)
def test_triton_interpreter(interpreter_results, case):
    result = interpreter_results.get(case, "missing")
    assert result == "ok", result


# ----------------------------------------------------------------------------- in-process (no kernels)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_expert_lists(dtype):
    from compiled.moe.experts import moe_experts_ref
    x, w, ids, w13, w2 = _problem(23, 8, 2, 32, 48, dtype, seed=20, used_experts=6)
    I = w2.shape[2]
    got = fm.fused_moe_ref(x, w, ids, w13, w2)
    want = moe_experts_ref(x, w, ids, [t[:I] for t in w13], [t[I:] for t in w13], list(w2))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_hf_experts(dtype):
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from transformers import Qwen3MoeConfig
    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                         intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, vocab_size=32)
    cfg._experts_implementation = "eager"
    experts = modeling.Qwen3MoeExperts(cfg).to(dtype)
    x, w, ids, w13, w2 = _problem(19, 8, 2, 32, 48, dtype, seed=21, used_experts=7)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        want = experts(x, ids, w.to(dtype))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(fm.fused_moe_ref(x, w, ids, w13, w2), want, **tol)


def test_op_on_cpu_is_reference_and_fake_shapes():
    before = fm.BACKEND.name
    fm.BACKEND.set("auto")
    try:
        x, w, ids, w13, w2 = _problem(6, 8, 2, 32, 48, seed=22)
        out = torch.ops.compiled.fused_moe(x, w, ids, w13, w2)
        torch.testing.assert_close(out, fm.fused_moe_ref(x, w, ids, w13, w2), atol=0, rtol=0)
        with pytest.raises(ValueError, match="COMPILED_MOE_BACKEND"):
            fm.BACKEND.set("bogus")
        assert fm.BACKEND.name == "auto"
    finally:
        fm.BACKEND.set(before)
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = (x.bfloat16(), w, ids, w13.bfloat16(), w2.bfloat16())
    with FakeTensorMode() as mode:
        out = torch.ops.compiled.fused_moe(*[mode.from_tensor(t) for t in real])
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert fm.fused_moe_ref(x[:0], w[:0], ids[:0], w13, w2).shape == (0, 32)


def test_ops_route_from_router_logits_on_cpu_and_refuse_bad_routing_operands():
    """With `router_logits` (the fuse_routing pass's operands) the ops route by the routing op's
    reference on the CPU: the same result as routed beforehand; both routings given, neither, or a
    top_k the logits cannot hold are one-line errors naming the op and the operand."""
    g = torch.Generator().manual_seed(23)
    x_moe, _, _, w13, w2 = _problem(5, 8, 2, 32, 48, seed=23)
    logits, x = torch.randn(5, 8, generator=g), torch.randn(5, 32, generator=g)
    nw, weight = 1 + 0.1 * torch.randn(32, generator=g), torch.randn(24, 32, generator=g)
    for renorm in (True, False):
        check_routed_ops(x, x_moe, logits, w13, w2, nw, weight, renorm, 1e-6)
    w, ids = topk_route_ref(logits, 2, True)
    bad = {"got both": dict(topk_weights=w, topk_ids=ids, router_logits=logits, top_k=2),
           "needs topk_weights and topk_ids, or router_logits": dict(topk_weights=None, topk_ids=None),
           r"top_k=9 must be 1 to the 8 experts": dict(topk_weights=None, topk_ids=None, router_logits=logits, top_k=9)}
    for message, operands in bad.items():
        with pytest.raises(ValueError, match=r"compiled::fused_moe: .*" + message) as e:
            torch.ops.compiled.fused_moe(x_moe, w13=w13, w2=w2, **operands)
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match=r"compiled::moe_add_rms_norm_linear: .*" + message):
            torch.ops.compiled.moe_add_rms_norm_linear(x, x_moe, w13=w13, w2=w2, norm_weight=nw, eps=1e-6,
                                                       weight=weight, keep_normed=False, **operands)


def test_moe_norm_op_bad_shapes_are_one_line_errors():
    import compiled.fusions.moe_norm_linear  # noqa: F401  (registers the op)
    x_moe, w, ids, w13, w2 = _problem(4, 8, 2, 32, 48)
    x, nw, weight = torch.randn(4, 32), torch.ones(32), torch.randn(24, 32)
    with pytest.raises(ValueError, match=r"compiled::moe_add_rms_norm_linear: moe_x \(4, 31\) torch.float32 "
                                         r"does not match x \(4, 32\)") as e:
        torch.ops.compiled.moe_add_rms_norm_linear(x, x_moe[:, :31], w, ids, w13, w2, nw, 1e-6, weight, False)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"compiled::moe_add_rms_norm_linear: norm weight \(31,\), expected \(32,\)"):
        torch.ops.compiled.moe_add_rms_norm_linear(x, x_moe, w, ids, w13, w2, nw[:31], 1e-6, weight, False)


def test_config_lookup(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILED_MOE_CONFIG_DIR", str(tmp_path))
    tuned_configs.clear_caches()
    name = tuned_configs.config_file_name(16, 48, "cpu", torch.float32)
    assert name == "E=16,N=48,device_name=cpu,dtype=float32.json"
    table = {"1": _cfg(16, 32, 64), "64": _cfg(32, 64, 64), "1024": dict(_cfg(64, 128, 64), down=dict(BLOCK_SIZE_N=64)),
             "_meta": {"note": "ignored"}}
    (tmp_path / name).write_text(json.dumps(table))
    try:
        assert tuned_configs.get_config(1, 16, 48, torch.float32)["BLOCK_SIZE_M"] == 16
        assert tuned_configs.get_config(40, 16, 48, torch.float32)["BLOCK_SIZE_M"] == 32
        cfg = tuned_configs.get_config(5000, 16, 48, torch.float32)
        up, down = tuned_configs.split_config(cfg)
        assert up["BLOCK_SIZE_N"] == 128 and down["BLOCK_SIZE_N"] == 64 and down["BLOCK_SIZE_M"] == 64
        assert tuned_configs.get_config(8, 99, 48, torch.float32) == tuned_configs.default_config(8, 99)  # no file: default
    finally:
        tuned_configs.clear_caches()


def test_checked_in_configs_are_complete():
    files = sorted(tuned_configs.CONFIG_DIR.glob("E=*,N=*,device_name=*,dtype=*.json"))
    assert files, "no tuned configs checked in"
    for path in files:
        raw = json.loads(path.read_text())
        table = {k: v for k, v in raw.items() if k.isdigit()}
        fp8 = path.name.endswith(f"dtype={tuned_configs.FP8_CONFIG_DTYPE}.json")
        # FP8 experts' tables (bench/gpu_fp8_tune.sh) up to 2,048 tokens, the most used counts first
        assert {int(k) for k in table} >= ({1, 8, 64, 512} if fp8 else {1, 8, 64, 512, 4096}), path.name
        assert set(raw) - set(table) <= {"_meta", "gemv"}, path.name
        if "gemv" in raw:
            tuned_configs.check_gemv(raw["gemv"], path.name)
        for T, cfg in table.items():
            tuned_configs.check_down_height(cfg, f"{path.name}: {T}")
            up, down = tuned_configs.split_config(cfg)
            for c in (up, down):
                assert c["BLOCK_SIZE_M"] in (16, 32, 64, 128, 256)
                assert c["BLOCK_SIZE_N"] >= 16 and c["BLOCK_SIZE_K"] >= 16 and c["num_warps"] in (1, 2, 4, 8, 16)
            if fp8:   # the entry's mode (or, where it names none, the token count's) is the one its tiles run
                want = tuned_configs.tuned_mode(cfg)
                want = int(T) >= fm.W8A8_MIN_TOKENS if want is None else want
                E, N = (int(part.split("=")[1]) for part in path.name.split(",")[:2])
                H = raw.get("_meta", {}).get("H", 2048)
                w13, w2 = torch.empty(E, 2 * N, H, device="meta"), torch.empty(E, H, N, device="meta")
                scales = fm.ExpertScales(w13, w2, [128, 128])
                groups = fm.w8a8_groups(scales, w13, w2, int(T), up, down, tuned_configs.tuned_mode(cfg))
                assert (groups is not None) == want, (path.name, T)


def test_max_padded_size_bounds_every_routing():
    for numel, E, bm in ((1, 128, 16), (8, 128, 64), (2400, 128, 16), (5, 3, 32)):
        worst = min(E, numel) * (bm - 1) + numel  # each used expert wastes at most bm - 1 rows
        assert fm.max_padded_size(numel, E, bm) == worst


# ----------------------------------------------------------------------------- GPU (real shapes)

E_REAL, H_REAL, I_REAL, K_REAL = 128, 2048, 768, 8


@pytest.fixture(scope="module")
def real_layer():
    torch.manual_seed(0)
    dev = "cuda"
    w13 = (torch.randn(E_REAL, 2 * I_REAL, H_REAL, device=dev) / H_REAL ** 0.5).bfloat16()
    w2 = (torch.randn(E_REAL, H_REAL, I_REAL, device=dev) / I_REAL ** 0.5).bfloat16()
    return w13, w2


def _real_inputs(T, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H_REAL, device="cuda", generator=g).bfloat16()
    logits = torch.randn(T, E_REAL, device="cuda", generator=g)
    w, ids = torch.ops.compiled.topk_route(logits, K_REAL, True)
    return x, w, ids


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 64, 300, 4096])
def test_gpu_fused_moe_real_shape_bf16(real_layer, T):
    w13, w2 = real_layer
    x, w, ids = _real_inputs(T, seed=T)
    out = torch.ops.compiled.fused_moe(x, w, ids, w13, w2)
    ref = fm.fused_moe_ref(x, w, ids, w13, w2)
    exact = fm.fused_moe_ref(x.float(), w, ids, w13.float(), w2.float())
    assert_bf16_within_reference(out, ref, exact, x.shape)


@pytest.mark.gpu
def test_gpu_one_token_gemv(real_layer):
    # the two GEMVs against the reference, several routings in a row, the same bits every time
    w13, w2 = real_layer
    for seed in range(5):
        x, w, ids = _real_inputs(1, seed=400 + seed)
        ref = fm.fused_moe_ref(x, w, ids, w13, w2)
        exact = fm.fused_moe_ref(x.float(), w, ids, w13.float(), w2.float())
        ref_err = (ref.float() - exact).abs().max().item()
        out = fm.fused_moe_triton(x, w, ids, w13, w2)
        assert (out.float() - exact).abs().max().item() <= 2 * ref_err + 1e-3
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
        for _ in range(3):
            assert torch.equal(fm.fused_moe_triton(x, w, ids, w13, w2), out)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 300, 4096])
def test_gpu_tma_weight_tiles(real_layer, T):
    w13, w2 = real_layer
    x, w, ids = _real_inputs(T, seed=500 + T)
    cfg = tuned_configs.get_config(T, E_REAL, I_REAL, torch.bfloat16, x.device)
    cfg = dict(cfg, TMA=1, down=dict(cfg.get("down") or {}, TMA=1))
    assert fm.weight_desc(w13, cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]) is not None
    out = fm.fused_moe_triton(x, w, ids, w13, w2, config=cfg)
    torch.testing.assert_close(out.float(), fm.fused_moe_ref(x, w, ids, w13, w2).float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [300, 2048, 4096])
@pytest.mark.parametrize("bm", [64, 128])
def test_gpu_quarter_height_tiles(real_layer, T, bm):
    # partial blocks take 16/32-row tiles (HALF_M=2) in both GEMMs, with and without TMA
    w13, w2 = real_layer
    x, w, ids = _real_inputs(T, seed=700 + T)
    ref = fm.fused_moe_ref(x, w, ids, w13, w2).float()
    for tma in (0, 1):
        cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=3,
                   HALF_M=2, TMA=tma, down=dict(BLOCK_SIZE_N=128, HALF_M=2, TMA=tma))
        assert tuned_configs.split_config(cfg)[1]["HALF_M"] == 2
        out = fm.fused_moe_triton(x, w, ids, w13, w2, config=cfg)
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [300, 2048])
def test_gpu_down_tiles_under_the_blocks(real_layer, T):
    # 128-row blocks, the down GEMM in 64-row tiles (32 / 16 for partial ones), with and without TMA
    w13, w2 = real_layer
    x, w, ids = _real_inputs(T, seed=800 + T)
    ref = fm.fused_moe_ref(x, w, ids, w13, w2).float()
    for tma in (0, 1):
        cfg = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3,
                   HALF_M=2, TMA=tma, down=dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, num_warps=4, HALF_M=2, TMA=tma))
        out = fm.fused_moe_triton(x, w, ids, w13, w2, config=cfg)
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_gpu_default_config(real_layer, T):
    w13, w2 = real_layer
    x, w, ids = _real_inputs(T, seed=100 + T)
    out = fm.fused_moe_triton(x, w, ids, w13, w2, config=tuned_configs.default_config(T, E_REAL))
    torch.testing.assert_close(out.float(), fm.fused_moe_ref(x, w, ids, w13, w2).float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_gpu_unused_experts_and_small_top_k(real_layer):
    w13, w2 = real_layer
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(33, H_REAL, device="cuda", generator=g).bfloat16()
    logits = torch.randn(33, E_REAL, device="cuda", generator=g)
    logits[:, 10:] -= 1e4
    for k in (1, 3):
        w, ids = torch.ops.compiled.topk_route(logits, k, True)
        out = torch.ops.compiled.fused_moe(x, w, ids, w13, w2)
        torch.testing.assert_close(out.float(), fm.fused_moe_ref(x, w, ids, w13, w2).float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 512])
def test_gpu_no_host_sync_and_cuda_graph(real_layer, T):
    w13, w2 = real_layer
    x, w, ids = _real_inputs(T, seed=200 + T)
    ws = fm.MoEWorkspace().reserve(T, E_REAL, H_REAL, I_REAL, K_REAL, torch.bfloat16, x.device)

    def run():
        return fm.fused_moe_triton(x, w, ids, w13, w2, workspace=ws)

    run()                                                 # compiles outside the checks
    graph, out = capture_without_host_sync(run)
    x2, w_2, ids2 = _real_inputs(T, seed=300 + T)
    x.copy_(x2), w.copy_(w_2), ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), fm.fused_moe_ref(x, w, ids, w13, w2).float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 2048])
def test_gpu_routing_from_logits_eager_and_graph(real_layer, T):
    # the op given the router's logits (the alignment's count kernel routing from 17 tokens of
    # top-8, the routing kernel first below) against the routing op then the op, eager and from a
    # CUDA graph replayed on new logits: the same ids, and outputs within bf16 rounding
    from compiled.moe.routing import Router, Routed, routed_buffers
    w13, w2 = real_layer
    x, _, _ = _real_inputs(T, seed=400 + T)
    logits = torch.randn(T, E_REAL, device="cuda")
    ws = fm.MoEWorkspace().reserve(T, E_REAL, H_REAL, I_REAL, K_REAL, torch.bfloat16, x.device)
    router = Router(logits, K_REAL, True)
    w, ids = routed_buffers(router)

    def run():
        return fm.fused_moe_triton(x, w, ids, w13, w2, workspace=ws, route=Routed(router, w, ids))

    for replay in (False, True):
        if replay:
            graph, out = capture_without_host_sync(run)
            logits.copy_(torch.randn(T, E_REAL, device="cuda"))
            graph.replay()
        else:
            out = run()
        torch.cuda.synchronize()
        want_w, want_ids = torch.ops.compiled.topk_route(logits, K_REAL, True)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(w, want_w, atol=1e-6, rtol=1e-5)
        want = fm.fused_moe_triton(x, want_w, want_ids, w13, w2)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 2048])
def test_gpu_moe_add_rms_norm_linear_eager_and_graph(real_layer, T):
    # the op's bits are those of the fused MoE followed by add_rms_norm_linear (the same sum's
    # rounding, the same norm arithmetic), eagerly and replayed from a CUDA graph; the next
    # layer's qkv shape. Where add_rms_norm_linear's own kernel takes the linear (one row: the
    # GEMV mode), it sums the squares in K steps and scales by 1 / rms after the dot, while the
    # op's linear reads the row kernel's normalised row: h keeps its bits, y and normed agree to
    # bf16's rounding.
    from compiled.linear.ops import use_kernel
    from compiled.fusions.moe_norm_linear import moe_add_rms_norm_linear_ref
    from tests.linear.test_linear_kernel import max_err
    w13, w2 = real_layer
    x_moe, w, ids = _real_inputs(T, seed=600 + T)
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H_REAL, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(H_REAL, device="cuda", generator=g)).bfloat16()
    weight = (torch.randn(5120, H_REAL, device="cuda", generator=g) / H_REAL ** 0.5).bfloat16()

    def fused():
        return torch.ops.compiled.moe_add_rms_norm_linear(x, x_moe, w, ids, w13, w2, nw, 1e-6, weight, True)

    def apart():
        moe = torch.ops.compiled.fused_moe(x_moe, w, ids, w13, w2)
        return torch.ops.compiled.add_rms_norm_linear(x, moe, nw, 1e-6, weight, True)
    prologue = use_kernel(x, weight)
    assert prologue == (T == 1)

    def same(outs, wants):
        for i, (got, want) in enumerate(zip(outs, wants)):
            if i != 1 and prologue:
                assert max_err(got, want) <= 1.6e-2
            else:
                assert torch.equal(got, want)
    expected = apart()
    same(fused(), expected)
    for got, ref in zip(expected, moe_add_rms_norm_linear_ref(x, x_moe, w, ids, w13, w2, nw, 1e-6, weight)):
        torch.testing.assert_close(got.float(), ref.float(), atol=6e-2, rtol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fused()
    x_moe.copy_(_real_inputs(T, seed=650 + T)[0])
    graph.replay()
    same(outs, apart())


@pytest.mark.gpu
def test_gpu_routing_kernel():
    from compiled.moe.routing import topk_route_triton
    logits = torch.randn(4096, E_REAL, device="cuda")
    for renorm in (True, False):
        w, ids = topk_route_triton(logits, K_REAL, renorm)
        ref_w, ref_ids = topk_route_ref(logits, K_REAL, renorm)
        torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
        assert (ids == ref_ids).float().mean().item() > 0.999



def test_tuner_merge_keeps_untuned_entries(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import tune_moe
    finally:
        sys.path.pop(0)
    path = tmp_path / tuned_configs.config_file_name(E_REAL, I_REAL, "NVIDIA_H100_80GB_HBM3", "bfloat16")
    assert not path.exists()  # falls back to the checked-in table of that name
    table, timings = tune_moe.kept_entries(path)
    checked_in = json.loads((tuned_configs.CONFIG_DIR / path.name).read_text())
    # every entry as it was, until a token count tuned replaces its own (a run cut short by its
    # time limit leaves the rest)
    assert table == {k: v for k, v in checked_in.items() if k != "_meta"}
    assert set(timings) <= set(table)
    path.write_text(json.dumps({"8": checked_in["8"], "_meta": {"timings_us": {"8": {"total": 1.0}}}}))
    assert tune_moe.kept_entries(path) == ({"8": checked_in["8"]}, {"8": {"total": 1.0}})


if __name__ == "__main__":
    _run_group(sys.argv[1])
