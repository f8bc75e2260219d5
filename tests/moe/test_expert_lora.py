"""compiled::fused_moe with expert LoRA: the torch reference against a naive per-pair loop and against the base
fused MoE, the Triton path against the reference, validation and tracing.

CPU: the Triton kernels run under TRITON_INTERPRET=1 in one subprocess (this file run as a script;
see tests/moe/test_moe_kernels.py), each case one test. GPU (`-m gpu`): the Qwen3-30B-A3B layer
(H 2048, I 768, E 128, top-8) with R = 16, S = 8 in bf16, with no host sync and replayed from a
CUDA graph."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from compiled.moe import expert_lora as el  # noqa: E402  (no triton kernels are defined by this import)
from compiled.moe import fused_moe as fm  # noqa: E402
from compiled.moe.routing import topk_route_ref  # noqa: E402
from tests.conftest import (assert_bf16_within_reference, assert_same_math, capture_without_host_sync, child_env,  # noqa: E402
                            rank_routing, run_cases, same_math_tolerance)

MARK = "@@EXPERT_LORA_CASES@@"
EXPERT_LORA = ("a13", "b13", "a2", "b2", "scale", "slot")


def fused_moe_lora(x, topk_weights, topk_ids, w13, w2, *lora):
    """compiled::fused_moe with its expert-LoRA operands (a13, b13, a2, b2, scale, slot)."""
    return torch.ops.compiled.fused_moe(x, topk_weights, topk_ids, w13, w2,
                                        **{f"lora_{n}": t for n, t in zip(EXPERT_LORA, lora)})


def _expert_operands(lora) -> dict:
    """moe_add_rms_norm_linear's expert-LoRA operands from fused_moe's (a13, b13, a2, b2, scale, slot)."""
    return {"lora_slot" if n == "slot" else f"moe_lora_{n}": t for n, t in zip(EXPERT_LORA, lora)}


def moe_norm_expert_lora(x, moe_x, topk_weights, topk_ids, w13, w2, nw, eps, weight, keep_normed, *lora):
    """compiled::moe_add_rms_norm_linear with the experts' LoRA operands (in fused_moe's order)."""
    return torch.ops.compiled.moe_add_rms_norm_linear(x, moe_x, topk_weights, topk_ids, w13, w2, nw, eps, weight,
                                                      keep_normed, **_expert_operands(lora))


def moe_add_rms_norm_linear_lora(x, moe_x, topk_weights, topk_ids, w13, w2, nw, eps, weight, keep_normed, a, b, scale,
                                 slot, slices, *lora):
    """compiled::moe_add_rms_norm_linear with the linear's LoRA operands and the experts' (fused_moe's order)."""
    return torch.ops.compiled.moe_add_rms_norm_linear(
        x, moe_x, topk_weights, topk_ids, w13, w2, nw, eps, weight, keep_normed, lora_a=a, lora_b=b, lora_scale=scale,
        lora_slot=slot, lora_slices=slices, **_expert_operands(lora[:5]))   # lora[5]: the same slots
SLOTS_7 = [0, -1, 2, 1, 0, -1, 2]


def problem(T, E, k, H, I, R, S, dtype=torch.float32, seed=0, slots=None, device="cpu"):
    """(x, topk_weights, topk_ids, w13, w2, a13, b13, a2, b2, scale, slot): fresh non-zero inputs,
    deltas of the base's size; slots drawn from -1..S-1 unless given."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    w, ids = topk_route_ref(torch.randn(T, E, generator=g), k, True)
    a13 = torch.randn(S, E, 2 * R, H, generator=g) / H ** 0.5
    b13 = torch.randn(S, E, 2 * I, R, generator=g) / R ** 0.5
    a2 = torch.randn(S, E, R, I, generator=g) / I ** 0.5
    b2 = torch.randn(S, E, H, R, generator=g) / R ** 0.5
    scale = torch.rand(S, 3, generator=g) + 0.5
    slot = (torch.randint(-1, S, (T,), generator=g) if slots is None else torch.tensor(slots)).to(torch.int32)
    cast = dict(dtype=dtype, device=device)
    return (x.to(**cast), w.to(device), ids.to(device), w13.to(**cast), w2.to(**cast), a13.to(**cast),
            b13.to(**cast), a2.to(**cast), b2.to(**cast), scale.to(device), slot.to(device))


def naive(x, w, ids, w13, w2, a13, b13, a2, b2, scale, slot):
    """Pair by pair in float64, straight from the op's definition."""
    T, k = ids.shape
    S, I, R = a13.shape[0], w2.shape[2], a2.shape[2]
    d = lambda t: t.double()  # noqa: E731
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        s = int(slot[t])
        for j in range(k):
            e = int(ids[t, j])
            h = d(x[t])
            gate, up = d(w13[e, :I]) @ h, d(w13[e, I:]) @ h
            if 0 <= s < S:
                gate = gate + float(scale[s, 0]) * d(b13[s, e, :I]) @ (d(a13[s, e, :R]) @ h)
                up = up + float(scale[s, 1]) * d(b13[s, e, I:]) @ (d(a13[s, e, R:]) @ h)
            act = F.silu(gate) * up
            o = d(w2[e]) @ act
            if 0 <= s < S:
                o = o + float(scale[s, 2]) * d(b2[s, e]) @ (d(a2[s, e]) @ act)
            out[t] += float(w[t, j]) * o
    return out


def _cfg(bm, bn, bk, group=1, **down):
    cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=group, num_warps=4, num_stages=2)
    return dict(cfg, down=down) if down else cfg


def _check_triton(args, cfg, dtype, slack=8.0):
    """The Triton path against the reference: fp32 tightly; bf16 / fp16 judged by the rounding
    error the reference itself makes in that dtype (the interpreter truncates where the GPU
    rounds, hence the slack, as for the base MoE)."""
    out = el.fused_moe_lora_triton(*args, config=cfg)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    exact = el.fused_moe_lora_ref(*[t.float() if t.is_floating_point() else t for t in args])
    if dtype == torch.float32:
        torch.testing.assert_close(out, exact, atol=2e-5, rtol=1e-5)
        return
    ref_err = (el.fused_moe_lora_ref(*args).float() - exact).abs().max().item()
    err = (out.float() - exact).abs().max().item()
    assert err <= slack * ref_err + 1e-3, (err, ref_err)


# ----------------------------------------------------------------------------- interpreter cases

def case_t7_h45_i19_fp32_mixed_slots():
    args = problem(7, 6, 3, 45, 19, 8, 3, slots=SLOTS_7, seed=1)
    _check_triton(args, _cfg(16, 16, 16), torch.float32)
    _check_triton(args, _cfg(16, 32, 32, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16), torch.float32)   # the down override


def case_t7_h45_i19_bf16_and_fp16():
    for dtype in (torch.bfloat16, torch.float16):
        _check_triton(problem(7, 6, 3, 45, 19, 8, 3, dtype, slots=SLOTS_7, seed=2), _cfg(16, 16, 32), dtype)


def case_t40_e8_k2_blocks_groups_and_out_of_range_slots():
    # 32-row blocks of many slots each, GROUP_M = 4; slots S and -5 act as no adapter
    args = problem(40, 8, 2, 32, 24, 16, 4, seed=3)
    args[-1][3], args[-1][17] = 4, -5
    _check_triton(args, _cfg(32, 16, 16, group=4), torch.float32)


def case_t40_one_adapter_tall_tiles():
    # a prefill's blocks: every row with an adapter on one slot (the one-slot delta), some rows
    # without; 32-row tiles add the deltas before their K loop
    slots = [2] * 40
    slots[5] = slots[31] = -1
    _check_triton(problem(40, 8, 2, 32, 24, 16, 4, slots=slots, seed=13), _cfg(32, 16, 16, group=4), torch.float32)


def case_one_token_top1_and_rank5():
    # one token (the base MoE's GEMV case runs the grouped tiles here), top-1 (no sum kernel),
    # a rank of 5 padded to a 16-wide tile
    _check_triton(problem(1, 8, 2, 48, 32, 8, 2, slots=[1], seed=4), _cfg(16, 32, 16), torch.float32)
    _check_triton(problem(9, 8, 1, 48, 32, 5, 2, seed=5), _cfg(16, 32, 16), torch.float32)


def case_no_adapter_is_the_base_moe():
    # every slot -1: the base fused MoE's result (the same sums in the same order but pointer loads)
    args = list(problem(23, 8, 2, 32, 48, 8, 3, seed=6))
    args[-1] = torch.full_like(args[-1], -1)
    out = el.fused_moe_lora_triton(*args, config=_cfg(16, 64, 32))
    base = fm.fused_moe_triton(*args[:5], config=_cfg(16, 64, 32))
    torch.testing.assert_close(out, base, atol=1e-6, rtol=1e-6)


def case_op_forced_triton_and_workspace_reuse():
    args = problem(9, 8, 2, 32, 48, 8, 3, seed=7)
    before = fm.BACKEND.name
    fm.BACKEND.set("triton")
    try:
        out = fused_moe_lora(*args)
    finally:
        fm.BACKEND.set(before)
    torch.testing.assert_close(out, el.fused_moe_lora_ref(*args), atol=2e-5, rtol=1e-5)
    ws = el.reserve_workspace(fm.MoEWorkspace(), 40, 8, 32, 48, 2, 8, torch.float32, torch.device("cpu"), 16)
    ptrs = {n: b.data_ptr() for n, b in ws.buffers.items()}
    for T, seed in ((40, 8), (3, 9), (17, 10)):
        args = problem(T, 8, 2, 32, 48, 8, 3, seed=seed)
        out = el.fused_moe_lora_triton(*args, config=_cfg(16, 64, 32), workspace=ws)
        torch.testing.assert_close(out, el.fused_moe_lora_ref(*args), atol=2e-5, rtol=1e-5)
    assert {n: b.data_ptr() for n, b in ws.buffers.items()} == ptrs, "workspace reallocated"


def case_other_ranks_pairs_are_skipped():
    # expert parallelism over 2 ranks of 4 experts (ids -1 for the other rank's pairs): each rank's
    # output is the naive loop with the other pairs at weight 0, and the two add up to the whole.
    # Scratch and outputs start as NaN: a row left unwritten, or one of the other rank's pairs
    # read, shows. The shrinks by pair (7 tokens), by block (40), top-1, and the norm's kernel.
    from compiled.fusions.moe_norm_linear import moe_add_rms_norm_linear_ref
    for T, k, max_pairs, seed in ((7, 3, 64, 14), (40, 2, 0, 15), (9, 1, 64, 16)):
        args = problem(T, 8, k, 45, 19, 8, 3, seed=seed)
        x, w, ids = args[:3]
        total = torch.zeros(T, 45, dtype=torch.float64)
        for first in (0, 4):
            w_r, ids_r, mine = rank_routing(w, ids, first, 4)
            local = [t[first:first + 4] for t in args[3:5]] + [t[:, first:first + 4] for t in args[5:9]]
            ws = el.reserve_workspace(fm.MoEWorkspace(), T, 4, 45, 19, k, 8, torch.float32, x.device, 16)
            for buf in ws.buffers.values():
                buf.fill_(float("nan") if buf.is_floating_point() else 0)
            with _pair_shrink_up_to(max_pairs):
                out = el.fused_moe_lora_triton(x, w_r, ids_r, *local, *args[9:], config=_cfg(16, 16, 16), workspace=ws)
            want = naive(x, torch.where(mine, w, 0.0), ids, *args[3:])
            torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
            ref = el.fused_moe_lora_ref(x, w_r, ids_r, *local, *args[9:])
            torch.testing.assert_close(ref.double(), want, atol=1e-4, rtol=1e-4)
            total += out.double()
            if k > 1 and max_pairs:
                nw, weight = torch.rand(45) + 0.5, torch.randn(24, 45)
                before = fm.BACKEND.name
                fm.BACKEND.set("triton")
                try:
                    got = moe_norm_expert_lora(x, x, w_r, ids_r, *local[:2], nw, 1e-6, weight, True, *local[2:],
                                               *args[9:])
                finally:
                    fm.BACKEND.set(before)
                for g_, r in zip(got, moe_add_rms_norm_linear_ref(x, x, w_r, ids_r, *local[:2], nw, 1e-6, weight,
                                                                  *local[2:], *args[9:])):
                    torch.testing.assert_close(g_, r, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(total, naive(*args), atol=1e-4, rtol=1e-4)


def case_sum_in_the_norm_kernel():
    # compiled::moe_add_rms_norm_linear with the LoRA tensors: the unsummed pairs of the LoRA MoE
    # summed by the norm's kernel, against the references of the two ops in a row
    from compiled.fusions.moe_norm_linear import moe_add_rms_norm_linear_ref
    g = torch.Generator().manual_seed(12)
    args = problem(7, 6, 3, 45, 19, 8, 3, slots=SLOTS_7, seed=12)
    x, nw, weight = torch.randn(7, 45, generator=g), 1 + 0.1 * torch.randn(45, generator=g), torch.randn(24, 45, generator=g)
    before = fm.BACKEND.name
    fm.BACKEND.set("triton")
    try:
        got = moe_norm_expert_lora(x, *args[:5], nw, 1e-6, weight, True, *args[5:])
    finally:
        fm.BACKEND.set(before)
    for g_, ref in zip(got, moe_add_rms_norm_linear_ref(x, *args[:5], nw, 1e-6, weight, *args[5:])):
        torch.testing.assert_close(g_, ref, atol=1e-4, rtol=1e-4)


def qkv_lora(T, H, slices, R, S, seed, device="cpu", dtype=torch.float32):
    """(weight, a, b, scale) of a linear H -> sum(slices) with rank-R LoRA on S slots."""
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, generator=g)
    weight = torch.randn(sum(slices), H, **kw) / H ** 0.5
    a = torch.randn(S, len(slices) * R, H, **kw) / H ** 0.5
    b = torch.randn(S, sum(slices), R, **kw) / R ** 0.5
    return weight.to(dtype), a.to(dtype), b.to(dtype), torch.rand(S, len(slices), **kw) + 0.5


def moe_norm_lora_ref(x, moe_args, nw, weight, a, b, scale, slot, slices):
    """moe_add_rms_norm_linear_lora's (y, h, normed) from the references in turn."""
    from compiled.fusions.moe_norm_linear import moe_add_rms_norm_linear_ref
    from compiled.linear.lora import lora_expand_ref, lora_shrink_ref
    y, h, normed = moe_add_rms_norm_linear_ref(x, *moe_args[:5], nw, 1e-6, weight, *moe_args[5:])
    return lora_expand_ref(y, lora_shrink_ref(normed, a, slot), b, scale, slot, slices), h, normed


def case_qkv_shrink_in_the_norm_kernel():
    # compiled::moe_add_rms_norm_linear_lora with the MoE and LoRA backends forced to Triton: at 1
    # and 17 tokens the norm's kernel sums the LoRA MoE's pairs and runs the qkv's shrink (3 slices
    # of rank 8: 24 and 3 programs a token), at 7 the shrink's own launch; the expand after the
    # linear; against the references in turn
    from compiled.fusions.moe_norm_linear import shrink_in_norm
    from compiled.linear import lora as linear_lora
    slices = [12, 6, 6]
    assert [shrink_in_norm(T) for T in (1, 7, 17)] == [True, False, True]
    before = fm.BACKEND.name, linear_lora.BACKEND.name
    fm.BACKEND.set("triton")
    linear_lora.set_backend("triton")
    try:
        for T in (1, 7, 17):
            args = problem(T, 6, 3, 45, 19, 8, 3, slots=(SLOTS_7 * 3)[:T], seed=14 + T)
            g = torch.Generator().manual_seed(14 + T)
            x, nw = torch.randn(T, 45, generator=g), 1 + 0.1 * torch.randn(45, generator=g)
            weight, a, b, scale = qkv_lora(T, 45, slices, 8, 3, seed=15 + T)
            got = moe_add_rms_norm_linear_lora(x, *args[:5], nw, 1e-6, weight, True, a, b, scale,
                                                                  args[10], slices, *args[5:])
            for g_, ref in zip(got, moe_norm_lora_ref(x, args, nw, weight, a, b, scale, args[10], slices)):
                torch.testing.assert_close(g_, ref, atol=1e-4, rtol=1e-4)
    finally:
        fm.BACKEND.set(before[0])
        linear_lora.set_backend(before[1])


def case_split_k_shrinks():
    # every shrink split along K: gate/up per pair in 2 ragged splits of 32 and 13 and down per
    # row in 3 of 16, then (pairs past PAIR_SHRINK_MAX_PAIRS) both per block, the same; each
    # twice: the second call finds the semaphores back at 0, and they are left so
    before = (el.SHRINK_MIN_K_PER_SPLIT, el.shrink_tiles, el.PAIR_MIN_K_PER_SPLIT, el.PAIR_SHRINK_BLOCK_K,
              el.ROW_SHRINK_BLOCK_K)
    el.SHRINK_MIN_K_PER_SPLIT, el.shrink_tiles = 16, lambda bm, K: (16, 2)
    el.PAIR_MIN_K_PER_SPLIT = el.PAIR_SHRINK_BLOCK_K = el.ROW_SHRINK_BLOCK_K = 16
    try:
        assert el.shrink_split(21, 45, 16) == 2 and el.shrink_split(21, 48, 16) == 3
        assert el.pair_shrink_split(21, 45, 16) == 2
        for max_pairs in (el.PAIR_SHRINK_MAX_PAIRS, 0):
            with _pair_shrink_up_to(max_pairs):
                for seed in (14, 15):
                    _check_triton(problem(7, 6, 3, 45, 48, 8, 3, slots=SLOTS_7, seed=seed), _cfg(16, 16, 16),
                                  torch.float32)
    finally:
        (el.SHRINK_MIN_K_PER_SPLIT, el.shrink_tiles, el.PAIR_MIN_K_PER_SPLIT, el.PAIR_SHRINK_BLOCK_K,
         el.ROW_SHRINK_BLOCK_K) = before
    for name in ("lora_shrink_semaphores", "lora_pair_semaphores"):
        assert not fm.zeroed(torch.device("cpu"), name, 1, torch.int32).any()


def case_gate_up_shrink_per_block():
    # past PAIR_SHRINK_MAX_PAIRS pairs the gate/up shrink runs per (block, slot) after the
    # alignment, its outputs in block order: mixed slots in 16- and 32-row blocks, one adapter
    with _pair_shrink_up_to(0):
        _check_triton(problem(7, 6, 3, 45, 19, 8, 3, slots=SLOTS_7, seed=1), _cfg(16, 16, 16), torch.float32)
        _check_triton(problem(40, 8, 2, 32, 24, 16, 4, seed=3), _cfg(32, 16, 16, group=4), torch.float32)
        _check_triton(problem(40, 8, 2, 32, 24, 16, 4, slots=[1] * 40, seed=13), _cfg(32, 16, 16), torch.float32)


def case_down_delta_as_last_k_steps():
    # decode sizes without TMA tiles: the down shrink a program a row writes scaled rows in x's
    # dtype and the down GEMM adds the delta as its last K steps: full rank 16 (unmasked along r)
    # and rank 5, K = I a whole number of steps and not, mixed slots, one slot, slots out of
    # range; against the after-the-loop delta of the same shrink (unscaled fp32 rows)
    slots = [0, 2, -1, 1, 0, 3, 2, 9, -4, 1, 0, 0, 2, 1]
    cases = [(problem(14, 6, 3, 45, 32, 16, 4, slots=slots, seed=20), _cfg(16, 16, 16)),
             (problem(14, 6, 3, 45, 40, 5, 4, slots=slots, seed=21), _cfg(16, 32, 16)),
             (problem(9, 8, 2, 48, 19, 16, 3, slots=[2] * 9, seed=22), _cfg(16, 16, 32)),
             (problem(7, 6, 3, 45, 19, 8, 3, dtype=torch.bfloat16, slots=SLOTS_7, seed=23), _cfg(16, 16, 16))]
    real = el.down_delta_in_k
    for args, cfg in cases:
        for in_k in (True, False):
            el.down_delta_in_k = lambda *a, in_k=in_k: in_k and real(*a)
            ws = fm.MoEWorkspace()
            try:
                with _limit("DELTA_IN_K_MIN_PAIRS", 0):
                    _check_triton(args, cfg, args[0].dtype)
                    el.fused_moe_lora_triton(*args, config=cfg, workspace=ws)
            finally:
                el.down_delta_in_k = real
            assert ("lora_s2_scaled" in ws.buffers) == in_k and ("lora_s2" in ws.buffers) != in_k


def case_expand_kernel_matches_its_reference():
    # moe_lora_expand_kernel against expand_ref on random rows: by pair (the gate and up deltas,
    # 2I = 46 split at 23, rank 5) and by token (the down deltas, H = 45, each token's pairs summed
    # times their weights), ids of -1 among the pairs, slots -1 and 9 (none) among 3, 16-column
    # programs: partial ones in each half; every row is written (the outputs start as NaN)
    g = torch.Generator().manual_seed(31)
    T, k, E, S, R, I, H = 7, 3, 6, 3, 5, 23, 45
    slot = torch.tensor([0, -1, 2, 1, 9, 0, 2], dtype=torch.int32)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).reshape(-1)
    ids[3] = ids[14] = -1
    scale = torch.rand(S, 3, generator=g) + 0.5
    weights = torch.rand(T * k, generator=g)
    pdl = el.launch_kwargs(torch.device("cpu"))
    with _limit("EXPAND_BLOCK_N", 16):
        sh, b = torch.randn(T * k, 2 * R, generator=g), torch.randn(S, E, 2 * I, R, generator=g)
        out = torch.full((T * k, 2 * I), float("nan"))
        el._expand(out, sh, b, scale, out, slot, ids, I, k, pdl)
        want = el.expand_ref(sh, b, scale, out, slot, ids, k, I, False)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        assert want.abs().max() > 1 and (want[3] == 0).all() and (want[3 * k:4 * k] != 0).all()
        sh2, b2 = torch.randn(T * k, R, generator=g), torch.randn(S, E, H, R, generator=g)
        d2 = torch.full((T, H), float("nan"))
        el._expand(d2, sh2, b2, scale, weights, slot, ids, H, k, pdl, by_token=True)
        want = el.expand_ref(sh2, b2, scale, weights, slot, ids, k, H, True)
        torch.testing.assert_close(d2, want, atol=1e-5, rtol=1e-5)
        assert want.abs().max() > 0.5 and (want[1] == 0).all()


@contextlib.contextmanager
def _limit(name, value):
    """expert_lora's constant `name` set to value inside the block."""
    before = getattr(el, name)
    setattr(el, name, value)
    try:
        yield
    finally:
        setattr(el, name, before)


def _pair_shrink_up_to(max_pairs):
    return _limit("PAIR_SHRINK_MAX_PAIRS", max_pairs)


CASES = [case_expand_kernel_matches_its_reference, case_split_k_shrinks, case_gate_up_shrink_per_block,
         case_down_delta_as_last_k_steps,
         case_t7_h45_i19_fp32_mixed_slots, case_sum_in_the_norm_kernel, case_qkv_shrink_in_the_norm_kernel,
         case_t7_h45_i19_bf16_and_fp16,
         case_t40_e8_k2_blocks_groups_and_out_of_range_slots, case_t40_one_adapter_tall_tiles,
         case_one_token_top1_and_rank5,
         case_no_adapter_is_the_base_moe, case_op_forced_triton_and_workspace_reuse,
         case_other_ranks_pairs_are_skipped]


@pytest.fixture(scope="module")
def interpreter_results():
    env = child_env(TRITON_INTERPRET="1", COMPILED_MOE_BACKEND=None)
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, cwd=str(REPO),
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        return {fn.__name__: f"crashed (rc {proc.returncode}):\n{proc.stderr[-4000:]}" for fn in CASES}
    return json.loads(lines[-1][len(MARK):])


@pytest.mark.parametrize("case", [fn.__name__ for fn in CASES])
def test_triton_interpreter(interpreter_results, case):
    result = interpreter_results.get(case, "missing")
    assert result == "ok", result


# ----------------------------------------------------------------------------- the reference (in-process)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_a_naive_pair_loop(dtype):
    args = problem(7, 6, 3, 45, 19, 8, 3, dtype, slots=SLOTS_7, seed=11)
    got = el.fused_moe_lora_ref(*args)
    assert got.dtype == dtype and got.shape == (7, 45)
    want = naive(*args)
    base = fm.fused_moe_ref(*args[:5]).double()
    assert (want - base).abs().max() > 0.1                                  # the deltas are not small
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=2e-2)


def test_reference_without_adapters_is_the_base_moe():
    """No adapter (every slot -1) or adapters of zeros: the base MoE, within the rounding of
    another grouping of its rows. The adapters' own delta is far above that tolerance, so a row
    given a delta it should not get (slot -1 read as the last slot, a zero adapter's scale
    applied to another's B) fails."""
    for dtype in (torch.float32, torch.bfloat16):
        args = list(problem(23, 8, 2, 32, 48, 8, 3, dtype, seed=12))
        base = fm.fused_moe_ref(*args[:5])
        none = list(args)
        none[-1] = torch.full_like(args[-1], -1)
        assert_same_math(el.fused_moe_lora_ref(*none), base)
        zero = list(args)                                                  # adapters of zeros: no change
        for i in (5, 6, 7, 8):
            zero[i] = torch.zeros_like(args[i])
        assert_same_math(el.fused_moe_lora_ref(*zero), base)
        delta = (el.fused_moe_lora_ref(*args).double() - base.double()).abs().max().item()
        assert delta > 20 * same_math_tolerance(base), (delta, same_math_tolerance(base))


def test_each_delta_uses_its_own_slices_and_scale():
    """Only slot 1's down B of expert e is non-zero: the output moves by weight * scale[1, 2] *
    b2 @ (a2 @ act) for the pairs (t, e) of slot-1 tokens, nowhere else."""
    args = list(problem(6, 4, 2, 16, 8, 4, 2, slots=[1, 1, 0, -1, 1, 0], seed=13))
    x, w, ids, w13, w2 = args[:5]
    for i in (6, 8):
        args[i] = torch.zeros_like(args[i])
    e = int(ids[0, 0])
    args[8][1, e] = torch.randn(16, 4)
    args[9][1, 2] = 2.5
    delta = el.fused_moe_lora_ref(*args) - fm.fused_moe_ref(x, w, ids, w13, w2)
    I = 8
    for t in range(6):
        want = torch.zeros(16)
        for j in range(2):
            if int(ids[t, j]) == e and t in (0, 1, 4):
                gate, up = (w13[e] @ x[t]).split(I)
                act = F.silu(gate) * up
                want += w[t, j] * 2.5 * args[8][1, e] @ (args[7][1, e] @ act)
        torch.testing.assert_close(delta[t], want, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- the op

def test_the_norm_op_needs_all_six_lora_tensors_or_none():
    args = problem(3, 6, 2, 16, 8, 4, 2, seed=13)
    x, nw, weight = torch.randn(3, 16), torch.ones(16), torch.randn(5, 16)
    with pytest.raises(ValueError, match=r"compiled::moe_add_rms_norm_linear: expert LoRA needs all of .*; "
                                         r"missing moe_lora_scale, lora_slot$"):
        moe_norm_expert_lora(x, *args[:5], nw, 1e-6, weight, False, *args[5:9])


def test_the_norm_op_with_the_linears_lora_on_cpu_is_the_references_in_turn():
    args = problem(5, 6, 2, 16, 8, 4, 2, seed=16)
    x, nw = torch.randn(5, 16), torch.rand(16) + 0.5
    weight, a, b, scale = qkv_lora(5, 16, [8, 4, 4], 4, 2, seed=17)
    y, h, normed = moe_add_rms_norm_linear_lora(x, *args[:5], nw, 1e-6, weight, True, a, b, scale,
                                                                   args[10], [8, 4, 4], *args[5:])
    for got, want in zip((y, h, normed), moe_norm_lora_ref(x, args, nw, weight, a, b, scale, args[10], [8, 4, 4])):
        assert_same_math(got, want)
    with pytest.raises(ValueError, match=r"compiled::moe_add_rms_norm_linear: a \(2, 8, 16\) has 8 rows, "
                                         r"expected 3 slices x rank 4"):
        moe_add_rms_norm_linear_lora(x, *args[:5], nw, 1e-6, weight, False, a[:, :8], b, scale,
                                                        args[10], [8, 4, 4], *args[5:])


def test_lora_up_config_leaves_room_for_two_programs_an_sm():
    tuned = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=256, num_stages=3, TMA=1)
    cfg = el.lora_up_config(tuned, 2)
    assert cfg == dict(tuned, BLOCK_SIZE_K=128) and tuned["BLOCK_SIZE_K"] == 256   # the table's entry untouched
    assert (16 + 2 * 64) * 128 * 2 * 3 <= el.SM_SHARED_BYTES // 2
    deep = dict(tuned, BLOCK_SIZE_K=128, num_stages=5)   # K steps stay at 128 or more, stages as tuned
    assert el.lora_up_config(deep, 2) == deep
    prefill = dict(tuned, BLOCK_SIZE_M=128, num_stages=4)
    assert el.lora_up_config(prefill, 2) == prefill   # larger tiles keep the tuned pipeline


def test_down_delta_runs_in_the_k_loop_only_at_its_sizes():
    """The down GEMM takes its delta as K steps from DELTA_IN_K_MIN_PAIRS to PAIR_SHRINK_MAX_PAIRS
    pairs, in 16-row tiles loaded through pointers, with at most 32 slots, whole slots a K step."""
    lo, hi = el.DELTA_IN_K_MIN_PAIRS, el.PAIR_SHRINK_MAX_PAIRS
    down = {"TMA": 0, "BLOCK_SIZE_K": 128}
    assert el.down_delta_in_k(lo, 16, down, 8, 16) and el.down_delta_in_k(hi, 16, {"BLOCK_SIZE_K": 64}, 32, 64)
    assert not el.down_delta_in_k(lo - 1, 16, down, 8, 16) and not el.down_delta_in_k(hi + 1, 16, down, 8, 16)
    assert not el.down_delta_in_k(hi, 16, dict(down, TMA=1), 8, 16) and not el.down_delta_in_k(hi, 32, down, 8, 16)
    assert not el.down_delta_in_k(hi, 16, down, 64, 16) and not el.down_delta_in_k(hi, 16, down, 8, 256)


def test_op_on_cpu_is_the_reference_fake_and_trace():
    before = fm.BACKEND.name
    fm.BACKEND.set("auto")
    try:
        args = problem(7, 6, 3, 45, 19, 8, 3, slots=SLOTS_7, seed=14)
        assert torch.equal(fused_moe_lora(*args), el.fused_moe_lora_ref(*args))
    finally:
        fm.BACKEND.set(before)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    real = problem(7, 6, 3, 45, 19, 8, 3, torch.bfloat16, slots=SLOTS_7, seed=15)
    with FakeTensorMode() as mode:
        out = fused_moe_lora(*[mode.from_tensor(t) for t in real])
    assert out.shape == (7, 45) and out.dtype == torch.bfloat16
    gm = make_fx(lambda *a: fused_moe_lora(*a) * 2, tracing_mode="fake")(*real)
    assert [str(n.target) for n in gm.graph.nodes if n.op == "call_function"] == [
        "compiled.fused_moe.default", "aten.mul.Tensor"]
    assert el.fused_moe_lora_ref(*[t[:0] if i in (0, 1, 2, 10) else t for i, t in enumerate(real)]).shape == (0, 45)


@pytest.mark.parametrize("index,bad,match", [
    (0, lambda t: t[:, :44], r"w13 \(6, 38, 45\), w2 \(6, 45, 19\): expected \[E, 2I, 44\] and \[E, 44, I\]"),
    (2, lambda t: t[:, :2], r"topk_weights \(7, 3\), topk_ids \(7, 2\)"),
    (5, lambda t: t[:, :, :15], r"a13 \(3, 6, 15, 45\), expected \(3, 6, 16, 45\)"),
    (6, lambda t: t[:, :5], r"b13 \(3, 5, 38, 8\), expected \(3, 6, 38, 8\)"),
    (8, lambda t: t.bfloat16(), "b2 is torch.bfloat16, x is torch.float32"),
    (9, lambda t: t[:, :2], r"scale \(3, 2\) torch.float32, expected \(3, 3\) torch.float32 \(gate, up, down\)"),
    (10, lambda t: t.long(), r"slot \(7,\) torch.int64, expected \(7,\) torch.int32"),
])
def test_bad_shapes_are_one_line_errors(index, bad, match):
    args = list(problem(7, 6, 3, 45, 19, 8, 3, slots=SLOTS_7, seed=16))
    args[index] = bad(args[index])
    with pytest.raises(ValueError, match=r"compiled::fused_moe: " + match) as e:
        fused_moe_lora(*args)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- GPU (real shapes)

E_REAL, H_REAL, I_REAL, K_REAL, R_REAL, S_REAL = 128, 2048, 768, 8, 16, 8


@pytest.fixture(scope="module")
def real_layer():
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(device="cuda", generator=g)
    E, H, I, R, S = E_REAL, H_REAL, I_REAL, R_REAL, S_REAL
    w13 = (torch.randn(E, 2 * I, H, **kw) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, **kw) / I ** 0.5).bfloat16()
    a13 = (torch.randn(S, E, 2 * R, H, **kw) / H ** 0.5).bfloat16()
    b13 = (torch.randn(S, E, 2 * I, R, **kw) / R ** 0.5).bfloat16()
    a2 = (torch.randn(S, E, R, I, **kw) / I ** 0.5).bfloat16()
    b2 = (torch.randn(S, E, H, R, **kw) / R ** 0.5).bfloat16()
    scale = torch.rand(S, 3, **kw) + 0.5
    return w13, w2, a13, b13, a2, b2, scale


def _real_inputs(T, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H_REAL, device="cuda", generator=g).bfloat16()
    logits = torch.randn(T, E_REAL, device="cuda", generator=g)
    w, ids = torch.ops.compiled.topk_route(logits, K_REAL, True)
    slot = torch.randint(-1, S_REAL, (T,), device="cuda", generator=g, dtype=torch.int32)
    return x, w, ids, slot


def _check_real(out, x, w, ids, slot, layer):
    w13, w2, a13, b13, a2, b2, scale = layer
    args = (x, w, ids, w13, w2, a13, b13, a2, b2, scale, slot)
    ref = el.fused_moe_lora_ref(*args)
    exact = el.fused_moe_lora_ref(*[t.float() if t.is_floating_point() else t for t in args])
    assert_bf16_within_reference(out, ref, exact, x.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 512])
def test_gpu_real_shape_no_host_sync_and_cuda_graph(real_layer, T):
    x, w, ids, slot = _real_inputs(T, seed=T)
    w13, w2, a13, b13, a2, b2, scale = real_layer
    ws = el.reserve_workspace(fm.MoEWorkspace(), T, E_REAL, H_REAL, I_REAL, K_REAL, R_REAL, torch.bfloat16, x.device)

    def run():
        return el.fused_moe_lora_triton(x, w, ids, w13, w2, a13, b13, a2, b2, scale, slot, workspace=ws)

    _check_real(fused_moe_lora(x, w, ids, w13, w2, a13, b13, a2, b2, scale, slot),
                x, w, ids, slot, real_layer)
    run()                                                 # compiles outside the checks
    graph, out = capture_without_host_sync(run)
    for seed in range(2):
        for dst, src in zip((x, w, ids, slot), _real_inputs(T, seed=100 + 10 * T + seed)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        _check_real(out, x, w, ids, slot, real_layer)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_without_adapters_matches_the_base_moe(real_layer, T):
    x, w, ids, slot = _real_inputs(T, seed=50 + T)
    w13, w2, a13, b13, a2, b2, scale = real_layer
    out = fused_moe_lora(x, w, ids, w13, w2, a13, b13, a2, b2, scale, torch.full_like(slot, -1))
    torch.testing.assert_close(out.float(), fm.fused_moe_ref(x, w, ids, w13, w2).float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [8, 64])
def test_gpu_sum_in_the_norm_kernel_matches_the_two_ops(real_layer, T):
    """moe_add_rms_norm_linear with the LoRA tensors (the norm's kernel sums the LoRA MoE's pairs)
    against fused_moe_lora then add_rms_norm_linear."""
    x_moe, w, ids, slot = _real_inputs(T, seed=70 + T)
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H_REAL, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(H_REAL, device="cuda", generator=g)).bfloat16()
    weight = (torch.randn(512, H_REAL, device="cuda", generator=g) / H_REAL ** 0.5).bfloat16()
    w13, w2, *lora = real_layer
    got = moe_norm_expert_lora(x, x_moe, w, ids, w13, w2, nw, 1e-6, weight, True, *lora, slot)
    delta = fused_moe_lora(x_moe, w, ids, w13, w2, *lora, slot)
    want = torch.ops.compiled.add_rms_norm_linear(x, delta, nw, 1e-6, weight, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpu_qkv_shrink_in_the_norm_kernel_matches_the_ops_in_turn(real_layer, T):
    """moe_add_rms_norm_linear_lora (at 1 and 64 rows the norm's kernel runs the 30B qkv's shrink;
    the GEMV's epilogue or the expand adds the deltas) against moe_add_rms_norm_linear,
    lora_shrink and lora_expand in turn, eager and replayed from a CUDA graph over fresh inputs."""
    slices = [4096, 512, 512]
    weight, a, b, scale = qkv_lora(T, H_REAL, slices, R_REAL, S_REAL, seed=T, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(T)

    def fresh(seed):
        x_moe, w, ids, slot = _real_inputs(T, seed=seed)
        x = torch.randn(T, H_REAL, device="cuda", generator=g).bfloat16()
        return [x, x_moe, w, ids, slot]

    live = fresh(80 + T)
    nw = (1 + 0.1 * torch.randn(H_REAL, device="cuda", generator=g)).bfloat16()
    w13, w2, *lora = real_layer

    def run():
        x, x_moe, w, ids, slot = live
        return moe_add_rms_norm_linear_lora(x, x_moe, w, ids, w13, w2, nw, 1e-6, weight, True, a,
                                                               b, scale, slot, slices, *lora, slot)

    def check(got):
        x, x_moe, w, ids, slot = live
        y, h, normed = moe_norm_expert_lora(x, x_moe, w, ids, w13, w2, nw, 1e-6, weight, True, *lora, slot)
        y = torch.ops.compiled.lora_expand(y, torch.ops.compiled.lora_shrink(normed, a, slot), b, scale, slot, slices)
        for got_, want in zip(got, (y, h, normed)):
            torch.testing.assert_close(got_.float(), want.float(), atol=5e-2, rtol=3e-2)

    check(run())
    graph, out = capture_without_host_sync(run)
    for seed in range(2):
        for dst, src in zip(live, fresh(90 + T + seed)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check(out)


def test_shrink_sweep_smoke_run_on_cpu():
    """bench/shrink_sweep.py --device cpu end to end (interpreted, tiny shapes): both shrinks swept,
    each line naming the launch the op makes and the fastest configs."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "shrink_sweep.py"), "--device", "cpu"],
                          env=child_env(TRITON_INTERPRET="1"), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "shrink (" in line]
    assert [line.split(",")[1].split("(")[0].strip() for line in lines] == ["gate/up shrink", "down shrink"], lines
    assert all(f"w{el.PAIR_SHRINK_WARPS} s3" in line and "best: bk16 w4 s1" in line for line in lines), lines


if __name__ == "__main__":   # run by the fixture above under TRITON_INTERPRET=1
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    print(MARK + json.dumps(run_cases(CASES)))
