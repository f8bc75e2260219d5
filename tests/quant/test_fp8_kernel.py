"""The W8A16 Triton kernels against the dequantize-then-compute references: on CPU under
TRITON_INTERPRET=1 (one subprocess), block scales with partial edges, per channel, per tensor.
The linear; the fused MoE's GEMVs (one token) and grouped GEMMs, with and without expert LoRA,
through `compiled::fused_moe` and `compiled::moe_add_rms_norm_linear`; the W8A16 linear and grouped
GEMMs on bf16 rows whose magnitudes lie past float16's range both ways. The W8A8 grouped GEMMs
(prefill sizes) and their activations' quantization kernel, against the references over the
dequantized experts and activations (the interpreter's fp8 x fp8 tl.dot is exact)."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from compiled.quant.config import QuantConfig
from compiled.quant.dequant import dequantize_blocks, quantize, resolve_block

CASES = [("block16x24_m3", 3, 56, 40, QuantConfig("fp8", "block", (16, 24))),
         ("block128_m1", 1, 72, 200, QuantConfig("fp8", "block", (128, 128))),
         ("channel_m17", 17, 40, 70, QuantConfig("compressed-tensors", "channel")),
         ("tensor_m5", 5, 33, 65, QuantConfig("compressed-tensors", "tensor"))]


def kernel_case(M: int, N: int, K: int, quant: QuantConfig) -> dict:
    import compiled.linear.library  # noqa: F401
    from compiled.linear import ops as lin
    from compiled.linear.fp8_kernels import w8a16_linear
    g = torch.Generator().manual_seed(M * N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    q, s = quantize(w, quant)
    block = list(quant.op_block)
    bo, bi = resolve_block(block, N, K)
    s = s.reshape(-(-N // bo), -(-K // bi))
    ref = torch.nn.functional.linear(x, dequantize_blocks(q, s, block, torch.float32))
    err = (w8a16_linear(x, q, s, block) - ref).abs().max().item()
    lin.set_backend("triton")   # the op's dispatch to the kernel
    err = max(err, (torch.ops.compiled.linear(x, q, weight_scale=s, weight_block=block) - ref).abs().max().item())
    if M > 16:   # the fused ops past the skinny GEMM's rows: their prologue's launch, then this kernel
        from compiled.linear import fused as fl
        delta, nw = torch.randn(M, K, generator=g), torch.rand(K, generator=g) + 0.5
        w = dequantize_blocks(q, s, block, torch.float32)
        y, h, _ = torch.ops.compiled.add_rms_norm_linear(x, delta, nw, 1e-6, q, False, weight_scale=s,
                                                          weight_block=block)
        ry, rh, _ = fl.add_rms_norm_linear_ref(x, delta, nw, 1e-6, w)
        gate_up = torch.randn(M, 2 * K, generator=g)
        got = torch.ops.compiled.silu_mul_linear(gate_up, q, weight_scale=s, weight_block=block)
        err = max(err, (y - ry).abs().max().item(), (h - rh).abs().max().item(),
                  (got - fl.silu_mul_linear_ref(gate_up, w)).abs().max().item())
    return dict(err=err, tol=1e-4)


SKINNY_CASES = [("skinny_gemv_block16x24", 1, None, QuantConfig("fp8", "block", (16, 24))),
                 ("skinny_tile_split_block16x24", 5, (16, 32, 2), QuantConfig("fp8", "block", (16, 24))),
                 ("skinny_gemv_split_channel", 1, (2, 64, 3), QuantConfig("compressed-tensors", "channel")),
                 ("skinny_tile_block128", 9, (32, 64, 1), QuantConfig("fp8", "block", (128, 128))),
                 ("skinny_gemv_block16x16", 1, None, QuantConfig("fp8", "block", (16, 16))),     # runs of 16, KB > 1
                 ("skinny_gemv_split_block8x8", 1, (2, 64, 2), QuantConfig("fp8", "block", (8, 8))),   # runs of 8
                 # four K steps, the last partial, all loaded before the wait (PRELOAD)
                 ("skinny_gemv_preload_block16x16", 1, (2, 64, 1), QuantConfig("fp8", "block", (16, 16)))]


def skinny_case(M: int, config: tuple | None, quant: QuantConfig) -> dict:
    """The skinny GEMM reading FP8 tiles (plain, RMSNorm and SiLU prologues; GEMV and tensor-core
    tiles, split K) against the references over the dequantized weight."""
    from compiled.linear import fused as fl
    from compiled.quant.dequant import WeightScale
    from compiled.linear.skinny_kernels import (SkinnyConfig, add_rms_norm_linear_triton, silu_mul_linear_triton,
                                                skinny_linear_triton)
    N, K = 52, 200
    g = torch.Generator().manual_seed(M * 7 + N)
    x, delta, nw = torch.randn(M, K, generator=g), torch.randn(M, K, generator=g), torch.rand(K, generator=g) + 0.5
    q, s, block = _stacked_fp8(torch.randn(1, N, K, generator=g) / K ** 0.5, quant)
    q, s = q[0], s[0]
    w = dequantize_blocks(q, s, block, torch.float32)
    cfg = None if config is None else SkinnyConfig(*config, gemv=config[0] <= 2)
    fp8 = WeightScale(s, block)
    errs = [(skinny_linear_triton(x, q, cfg, fp8=fp8) - x @ w.T).abs().max() / (x @ w.T).abs().max()]
    y, h, normed = add_rms_norm_linear_triton(x, delta, nw, 1e-6, q, True, cfg, fp8=fp8)
    ry, rh, rn = fl.add_rms_norm_linear_ref(x, delta, nw, 1e-6, w)
    errs += [(y - ry).abs().max() / ry.abs().max(), (normed - rn).abs().max() / rn.abs().max()]
    q2, s2, _ = _stacked_fp8(torch.randn(1, N, K // 2, generator=g), quant)
    w2 = dequantize_blocks(q2[0], s2[0], block, torch.float32)
    got = silu_mul_linear_triton(x, q2[0], cfg, fp8=WeightScale(s2[0], block))
    want = fl.silu_mul_linear_ref(x, w2)
    errs.append((got - want).abs().max() / want.abs().max())
    return dict(err=max(e.item() for e in errs), tol=1e-5, scale=1.0)


LORA_CASES = [("lora_gemv", 1), ("lora_skinny_tile", 5), ("lora_w8a16", 20)]


def lora_case(M: int) -> dict:
    """The linear family's LoRA bodies over an FP8 weight on the Triton path (the skinny GEMM with
    the deltas in its epilogue, the shrink doing the prologue; the W8A16 kernel beside the shrink)
    against the torch path over the dequantized weight."""
    from compiled.linear import lora as lora_ops
    from compiled.linear import ops as lin
    quant = QuantConfig("fp8", "block", (16, 24))
    N, K, S, R = 48, 64, 3, 8
    g = torch.Generator().manual_seed(M)
    x, delta, nw = torch.randn(M, K, generator=g), torch.randn(M, K, generator=g), torch.rand(K, generator=g) + 0.5
    q, s, block = _stacked_fp8(torch.randn(1, N, K, generator=g) / K ** 0.5, quant)
    q, s = q[0], s[0]
    w = dequantize_blocks(q, s, block, torch.float32)
    lora = dict(lora_a=torch.randn(S, 2 * R, K, generator=g) / 4, lora_b=torch.randn(S, N, R, generator=g) / 4,
                lora_scale=torch.rand(S, 2, generator=g) + 0.5,
                lora_slot=torch.tensor([i % (S + 1) - 1 for i in range(M)], dtype=torch.int32),
                lora_slices=[N // 2, N // 2])
    q2, s2, _ = _stacked_fp8(torch.randn(1, N, K // 2, generator=g) / K ** 0.5, quant)
    w2 = dequantize_blocks(q2[0], s2[0], block, torch.float32)
    lora2 = dict(lora, lora_a=torch.randn(S, 2 * R, K // 2, generator=g) / 4)
    calls = [lambda wt, fp8: torch.ops.compiled.linear(x, wt, **lora, **fp8),
             lambda wt, fp8: torch.ops.compiled.add_rms_norm_linear(x, delta, nw, 1e-6, wt, True, **lora, **fp8)[0],
             lambda wt, fp8: torch.ops.compiled.silu_mul_linear(x, wt, **lora2, **fp8)]
    errs = []
    for call, (qw, sw, dw) in zip(calls, [(q, s, w), (q, s, w), (q2[0], s2[0], w2)]):
        lin.set_backend("torch")
        lora_ops.set_backend("torch")
        want = call(dw, {})
        lin.set_backend("triton")
        lora_ops.set_backend("triton")
        got = call(qw, dict(weight_scale=sw, weight_block=block))
        errs.append(((got - want).abs().max() / want.abs().max()).item())
    return dict(err=max(errs), tol=1e-5, scale=1.0)


# the W8A16 / W8A8 dense kernel with the rows' LoRA deltas in its epilogue (qkv's three slices):
# partial row and column tiles, slots -1 and 5 (none) among 3; W8A16, W8A8, W8A8 swapped
LORA_EPILOGUE_CASES = [("lora_epilogue_w8a16", (32, 32, 32, 1, 4, 2, False, False)),
                       ("lora_epilogue_w8a8", (32, 32, 32, 1, 4, 2, True, False)),
                       ("lora_epilogue_w8a8_swap", (16, 32, 32, 1, 4, 2, True, True))]


def _refuses(call) -> bool:
    """Whether call() raises a ValueError."""
    try:
        call()
    except ValueError:
        return True
    return False


def lora_epilogue_case(config: tuple) -> dict:
    """`w8a16_linear` with `lora` against `lora_expand_ref` over its output without it (the same
    kernel and tiles, so the epilogue alone is judged), and `linear_then_expand`, which takes the
    epilogue for this shape, against the same; a split config and the skinny GEMM's rows refuse
    the operand."""
    from compiled.linear import fp8 as fp8_linear
    from compiled.linear import lora as lora_ops
    from compiled.linear import ops as lin
    from compiled.linear.fp8_kernels import W8A16Config, w8a16_linear
    from compiled.linear.lora import lora_expand_ref
    from compiled.linear.lora_kernels import LoRAArgs
    from compiled.linear.lora_linear import linear_then_expand
    from compiled.quant.dequant import WeightScale
    M, N, K, S, R, slices = 37, 144, 96, 3, 8, [80, 40, 24]   # N past the narrow weights (`max_rows`)
    g = torch.Generator().manual_seed(sum(config[:3]))
    x = torch.randn(M, K, generator=g)
    q, sc, block = _stacked_fp8(torch.randn(1, N, K, generator=g) / K ** 0.5, QuantConfig("fp8", "block", (32, 32)))
    q, sc = q[0], sc[0]
    s = torch.randn(M, len(slices) * R, generator=g)
    b, scale = torch.randn(S, N, R, generator=g) / R ** 0.5, torch.rand(S, len(slices), generator=g) + 0.5
    slot = torch.tensor([i % (S + 2) - 1 for i in range(M)], dtype=torch.int32)
    cfg = W8A16Config(*config)
    base = w8a16_linear(x, q, sc, block, cfg)
    want = lora_expand_ref(base, s, b, scale, slot, slices)
    got = w8a16_linear(x, q, sc, block, cfg, lora=LoRAArgs.of(s, b, scale, slot, slices))
    before = lin.BACKEND.name, lora_ops.BACKEND.name
    lin.set_backend("triton")
    lora_ops.set_backend("triton")
    fp8 = WeightScale(sc, block)
    try:
        takes = fp8_linear.lora_in_epilogue(x, q, fp8)
        via_op = linear_then_expand(x, q, s, b, scale, slot, slices, fp8) if takes else None
        # 8 rows: the skinny GEMM's, which takes LoRA through its own bodies, not this operand
        refused = _refuses(lambda: fp8_linear.linear(x[:8], q, fp8, lora=LoRAArgs.of(s[:8], b, scale, slot[:8],
                                                                                    slices)))
    finally:
        lin.set_backend(before[0])
        lora_ops.set_backend(before[1])
    refused = refused and _refuses(lambda: w8a16_linear(x, q, sc, block, cfg._replace(split_k=2),
                                                        lora=LoRAArgs.of(s, b, scale, slot, slices)))
    top = want.abs().max().item()
    err = (got - want).abs().max().item() / top
    if via_op is not None:
        err = max(err, (via_op - lora_expand_ref(w8a16_linear(x, q, sc, block), s, b, scale, slot, slices)
                        ).abs().max().item() / top)
    return dict(err=err, tol=1e-5, delta=(base - want).abs().max().item() / top, scale=top,
                expand_as_asked=via_op is not None and refused)


MOE_CASES = [("moe_gemv_block16x24", 1, QuantConfig("fp8", "block", (16, 24)), torch.float32, False),
             ("moe_gemv_block16x16", 1, QuantConfig("fp8", "block", (16, 16)), torch.float32, False),   # KB > 1
             ("moe_gemv_block16x8", 1, QuantConfig("fp8", "block", (16, 8)), torch.float32, False),     # runs of 8
             ("moe_gemv_block128_bf16", 1, QuantConfig("fp8", "block", (128, 128)), torch.bfloat16, False),
             ("moe_grouped_block16x24", 7, QuantConfig("fp8", "block", (16, 24)), torch.float32, False),
             ("moe_grouped_block128_bf16", 5, QuantConfig("fp8", "block", (128, 128)), torch.bfloat16, False),
             ("moe_grouped_channel", 9, QuantConfig("compressed-tensors", "channel"), torch.float32, False),
             ("moe_lora_block16x24", 6, QuantConfig("fp8", "block", (16, 24)), torch.float32, True),
             ("moe_lora_gemv_block16x24", 1, QuantConfig("fp8", "block", (16, 24)), torch.float32, True)]


# the one-token down GEMV's 3 K steps (the last partial), 2 scale blocks each, all read before its
# wait (PRELOAD), the up GEMV letting it in after its own
GEMV_PRELOAD_CASES = [("moe_gemv_preload_block16x8", QuantConfig("fp8", "block", (16, 8)))]


def gemv_preload_case(quant: QuantConfig) -> dict:
    """The one-token GEMVs with the down GEMV's K range preloaded against the torch reference over
    the dequantized experts."""
    from compiled.moe import fused_moe as fm
    from compiled.triton_utils import preload_fits
    E, H, I, k = 4, 48, 40, 3
    tiles = dict(up=dict(BLOCK_N=8, BLOCK_K=32, num_warps=1), down=dict(BLOCK_N=16, BLOCK_K=16, num_warps=1))
    g = torch.Generator().manual_seed(H * I)
    x = torch.randn(1, H, generator=g)
    topk_weights, topk_ids = _routing(g, 1, E, k)
    q13, s13, q2, s2, block = _fp8_experts(g, E, H, I, quant)
    got = fm.fused_moe_triton(x, topk_weights, topk_ids, q13, q2, gemv_tiles=tiles,
                              scales=fm.ExpertScales(s13, s2, block))
    fm.BACKEND.set("torch")
    want = torch.ops.compiled.fused_moe(x, topk_weights, topk_ids, dequantize_blocks(q13, s13, block, torch.float32),
                                        dequantize_blocks(q2, s2, block, torch.float32))
    fm.BACKEND.set("triton")
    top = want.abs().max().item()
    down = tiles["down"]
    return dict(err=(got - want).abs().max().item() / top, tol=1e-5, scale=top,
                preloaded=preload_fits(down["BLOCK_N"], down["BLOCK_K"], I, down["num_warps"]) == 3)


def _stacked_fp8(w: torch.Tensor, quant: QuantConfig) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    rows, cols = w.shape[1:]
    bo, bi = resolve_block(list(quant.op_block), rows, cols)
    pairs = [quantize(m, quant) for m in w]
    scales = torch.stack([p[1].reshape(-(-rows // bo), -(-cols // bi)) for p in pairs])
    # blocks of very different scales, so that a tile scaled by a neighbouring block's scale is far off
    spread = 0.25 + 1.75 * torch.rand(scales.shape, generator=torch.Generator().manual_seed(rows * cols))
    return torch.stack([p[0] for p in pairs]), scales * spread, list(quant.op_block)


def _routing(g: torch.Generator, T: int, E: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routing of T tokens to k distinct experts of E: (topk_weights, topk_ids)."""
    return torch.rand(T, k, generator=g), torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])


def _fp8_experts(g: torch.Generator, E: int, H: int, I: int, quant: QuantConfig) -> tuple:
    """Random experts (w13 `[E, 2I, H]`, w2 `[E, H, I]`, ~ 1 / sqrt(fan-in)) quantized at `quant`:
    (q13, s13, q2, s2, block)."""
    q13, s13, block = _stacked_fp8(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5, quant)
    q2, s2, _ = _stacked_fp8(torch.randn(E, H, I, generator=g) / I ** 0.5, quant)
    return q13, s13, q2, s2, block


def _expert_lora(g: torch.Generator, T: int, E: int, H: int, I: int, dtype: torch.dtype) -> tuple:
    S, R = 2, 4
    a13, b13 = torch.randn(S, E, 2 * R, H, generator=g) / 4, torch.randn(S, E, 2 * I, R, generator=g) / 4
    a2, b2 = torch.randn(S, E, R, I, generator=g) / 4, torch.randn(S, E, H, R, generator=g) / 4
    slot = torch.tensor([i % (S + 1) - 1 for i in range(T)], dtype=torch.int32)
    return tuple(t.to(dtype) for t in (a13, b13, a2, b2)) + (torch.rand(S, 3, generator=g) + 0.5, slot)


# bf16 rows from 1e-5 to 1e6, past float16's range at both ends: a W8A16 GEMM that ran its dots in
# float16 on rows cast as they are (one conversion for two fp8 weights, where bf16 takes more)
# would overflow (inf) or lose the small rows' digits
ROW_SCALES = (1e6, 1e-5, 1.0, 3e4, 2e-3, 1e5)
RANGE_CASES = [("moe_grouped_bf16_rows_far_apart", ROW_SCALES)]
LINEAR_RANGE_CASES = [("w8a16_bf16_rows_far_apart", ROW_SCALES)]


def _row_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error of a row relative to that row's largest value; inf where got is not finite."""
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).abs().amax(dim=1) / want.abs().amax(dim=1)).max().item()


def linear_range_case(row_scales: tuple[float, ...]) -> dict:
    """The W8A16 linear kernel, K steps inside the 128 x 128 blocks (one a step) and a partial last
    block, on bf16 rows of very different magnitudes against the same rows times the dequantized
    weight in fp32."""
    from compiled.linear.fp8_kernels import W8A16Config, w8a16_linear
    M, N, K = len(row_scales), 72, 200
    g = torch.Generator().manual_seed(M * N)
    x = (torch.randn(M, K, generator=g) * torch.tensor(row_scales)[:, None]).bfloat16()
    q, s, block = _stacked_fp8(torch.randn(1, N, K, generator=g) / K ** 0.5, QuantConfig("fp8", "block", (128, 128)))
    got = w8a16_linear(x, q[0], s[0], block, W8A16Config(16, 32, 128, 1, 4, 2))
    return dict(err=_row_err(got, x.float() @ dequantize_blocks(q[0], s[0], block, torch.float32).T), tol=0.02)


def moe_range_case(row_scales: tuple[float, ...]) -> dict:
    """The grouped GEMMs over 128 x 128 block FP8 experts with bf16 rows of very different
    magnitudes against the Triton path over the dequantized experts, each row's error relative to
    its own largest output."""
    from compiled.moe import fused_moe as fm
    T, E, H, I, k = len(row_scales), 4, 48, 40, 2
    g = torch.Generator().manual_seed(T * 97)
    x = (torch.randn(T, H, generator=g) * torch.tensor(row_scales)[:, None]).bfloat16()
    topk_weights, topk_ids = _routing(g, T, E, k)
    q13, s13, q2, s2, block = _fp8_experts(g, E, H, I, QuantConfig("fp8", "block", (128, 128)))
    w13, w2 = (dequantize_blocks(q, s, block, torch.bfloat16) for q, s in ((q13, s13), (q2, s2)))
    fm.BACKEND.set("triton")
    want = torch.ops.compiled.fused_moe(x, topk_weights, topk_ids, w13, w2).float()
    got = torch.ops.compiled.fused_moe(x, topk_weights, topk_ids, q13, q2, w13_scale=s13, w2_scale=s2,
                                       weight_block=block).float()
    return dict(err=_row_err(got, want), tol=0.05)


DEQUANT_CASES = [("dequant_block16x24", 37, 50, [16, 24], torch.float32),
                 ("dequant_block128_bf16", 130, 257, [128, 128], torch.bfloat16),
                 ("dequant_channel", 45, 70, [1, 0], torch.float32), ("dequant_tensor", 19, 33, [0, 0], torch.bfloat16)]


def dequant_case(rows: int, cols: int, block: list[int], dtype: torch.dtype) -> dict:
    """The Triton dequantization (prefill's FP8 linears on CUDA) against the float64 reference."""
    from compiled.quant.dequant_kernel import dequantize_triton
    g = torch.Generator().manual_seed(rows * cols)
    q = (torch.randn(rows, cols, generator=g) * 100).to(torch.float8_e4m3fn)
    bo, bi = resolve_block(block, rows, cols)
    scale = torch.rand(-(-rows // bo), -(-cols // bi), generator=g) + 0.01
    want = dequantize_blocks(q, scale, block, dtype).float()
    got = dequantize_triton(q, scale, block, dtype).float()
    # fp32 products rounded once more than the exact ones: a last-bit difference at most (bf16's
    # last bit is up to 2^-7 of a value; twice that as the margin)
    return dict(err=((got - want).abs() / want.abs().clamp_min(1e-30)).max().item(),
                tol=1e-6 if dtype == torch.float32 else 2 ** -6)


def moe_case(T: int, quant: QuantConfig, dtype: torch.dtype, lora: bool) -> dict:
    """The op on its Triton path (FP8 tiles scaled in the kernels) against the torch reference
    over the dequantized experts; and the fused norm op beside the two ops it fuses."""
    import compiled.fusions.moe_norm_linear  # noqa: F401
    from compiled.moe import fused_moe as fm
    E, H, I, k = 4, 48, 40, 2
    g = torch.Generator().manual_seed(T * 31 + len(quant.op_block))
    x = torch.randn(T, H, generator=g).to(dtype)
    topk_weights, topk_ids = _routing(g, T, E, k)
    q13, s13, q2, s2, block = _fp8_experts(g, E, H, I, quant)
    extra = dict(zip(("lora_a13", "lora_b13", "lora_a2", "lora_b2", "lora_scale", "lora_slot"),
                     _expert_lora(g, T, E, H, I, dtype))) if lora else {}
    fp8 = dict(w13_scale=s13, w2_scale=s2, weight_block=block)
    w13, w2 = dequantize_blocks(q13, s13, block, dtype), dequantize_blocks(q2, s2, block, dtype)
    # fp32: the torch reference; 16-bit: the Triton path over the dequantized weights, which rounds
    # where the FP8 path does (the reference's own rounding differs from both by more)
    fm.BACKEND.set("torch" if dtype == torch.float32 else "triton")
    ref = torch.ops.compiled.fused_moe(x, topk_weights, topk_ids, w13, w2, **extra).float()
    fm.BACKEND.set("triton")
    got = torch.ops.compiled.fused_moe(x, topk_weights, topk_ids, q13, q2, **extra, **fp8).float()
    err = (got - ref).abs().max().item()
    norm, resid, w = torch.rand(H, generator=g) + 0.5, torch.randn(T, H, generator=g).to(dtype), torch.randn(24, H)
    moe_lora = {"moe_" + name: t for name, t in extra.items() if name != "lora_slot"}
    if lora:   # and the linear's own adapters (2 slots, rank 4), on the FP8 weight below
        moe_lora.update(lora_slot=extra["lora_slot"], lora_a=(torch.randn(2, 4, H, generator=g) / 4).to(dtype),
                        lora_b=(torch.randn(2, 24, 4, generator=g) / 4).to(dtype),
                        lora_scale=torch.rand(2, 1, generator=g) + 0.5, lora_slices=[24])
    # the fused op's linear (the next layer's qkv) FP8 as well, through its kernel
    from compiled.linear import ops as lin
    qw, sw, _ = _stacked_fp8(w[None], quant)
    lin.set_backend("triton")
    fused = torch.ops.compiled.moe_add_rms_norm_linear(resid, x, topk_weights, topk_ids, q13, q2, norm, 1e-6,
                                                       qw[0], True, **moe_lora, **fp8, weight_scale=sw[0])
    # the references' paths as above: torch in fp32; in 16-bit the Triton kernels over the
    # dequantized weights (torch's CPU bf16 linear rounds differently from one machine to another)
    lin.set_backend("torch" if dtype == torch.float32 else "triton")
    fm.BACKEND.set("torch" if dtype == torch.float32 else "triton")
    want = torch.ops.compiled.moe_add_rms_norm_linear(resid, x, topk_weights, topk_ids, w13, w2, norm, 1e-6,
                                                      dequantize_blocks(qw[0], sw[0], block, dtype), True, **moe_lora)
    # relative to each output's largest magnitude. bf16: the interpreter's own conversions to bf16
    # (the FP8 tiles', the outputs') round otherwise than torch's, 1-3% of the largest output
    # between the two paths depending on the host; a missing or misplaced scale (0.25-2x) is far more
    rel = max([err / ref.abs().max().item()]
              + [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(fused, want)])
    return dict(err=rel, tol=1e-5 if dtype == torch.float32 else 0.05, scale=ref.abs().max().item())


ACT_QUANT_CASES = [("act_quant_bf16_group128", 5, 200, 128, torch.bfloat16),
                   ("act_quant_fp32_group32", 7, 75, 32, torch.float32),
                   ("act_quant_fp32_group16", 3, 50, 16, torch.float32),
                   # 4 rows by 2 groups a program: live rows cut one, the last group's programs partial
                   ("act_quant_bf16_programs", 37, 300, 128, torch.bfloat16),
                   ("act_quant_fp32_group_programs", 40, 330, 32, torch.float32),   # 11 groups: 8 + 3 a row
                   # a long batch: 16 rows by one group a program, the last row tile and group partial
                   ("act_quant_bf16_long_batch", 300, 260, 128, torch.bfloat16)]


def act_quant_case(T: int, K: int, group: int, dtype: torch.dtype) -> dict:
    """The activations' per-token-group FP8 quantization kernel against its torch reference: rows
    of very different magnitudes, a partial last group, an all-zero group (row 1's first)."""
    from compiled.quant.act_quant import quantize_per_token_group, quantize_per_token_group_ref
    g = torch.Generator().manual_seed(T * K + group)
    x = (torch.randn(T, K, generator=g) * (torch.rand(T, 1, generator=g) * 100 + 0.01)).to(dtype)
    x[1, :group] = 0
    q, s = quantize_per_token_group(x, group)
    rq, rs = quantize_per_token_group_ref(x, group)
    scale_err = ((s - rs).abs() / rs).max().item()
    # a value rounded the other way across a tie is one e4m3 step (2^-3 relative, 2^-9 subnormal) off
    steps = ((q.float() - rq.float()).abs() / (rq.float().abs() * 2 ** -3 + 2 ** -9)).max().item()
    zero_ok = bool(torch.isfinite(s[1, 0]) and s[1, 0] > 0 and (q[1, :group].float() == 0).all())
    # live_rows: the rows before it as without it, those after it left as they were
    live = T // 2
    lq, ls = q.clone().fill_(2.0), torch.full_like(s, -1.0)
    quantize_per_token_group(x, group, out=lq, scale_out=ls, live_rows=torch.tensor([live], dtype=torch.int32))
    live_ok = bool(torch.equal(lq[:live].float(), q[:live].float()) and torch.equal(ls[:live], s[:live])
                   and (lq[live:].float() == 2.0).all() and (ls[live:] == -1.0).all())
    # scales written column-major (cuBLAS's layout): the same values
    cs = torch.full((s.shape[1], T), -1.0).t()
    quantize_per_token_group(x, group, scale_out=cs)
    live_ok = live_ok and bool(torch.equal(cs, s))
    return dict(err=max(scale_err / 1e-6, steps), tol=1.0, zero_group=zero_ok, shape=list(s.shape),
                want_shape=[T, -(-K // group)], live_rows=live_ok)


W8A8_CASES = [("w8a8_block16x32", 37, 72, 40, QuantConfig("fp8", "block", (16, 32)), torch.float32),
              ("w8a8_block128", 33, 200, 136, QuantConfig("fp8", "block", (128, 128)), torch.float32),
              ("w8a8_block128_bf16", 33, 200, 136, QuantConfig("fp8", "block", (128, 128)), torch.bfloat16),
              ("w8a8_channel", 20, 96, 64, QuantConfig("compressed-tensors", "channel"), torch.float32),
              # N tiles inside the 32-row blocks, w13's up half's too: one weight scale a tile
              ("w8a8_one_scale_a_tile", 29, 96, 64, QuantConfig("fp8", "block", (32, 32)), torch.float32,
               dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                    HALF_M=0, TMA=0)),
              # a few tokens in 64-row tiles, W8A8 because the entry says so (`tuned_configs.MODE_KEY`)
              # below W8A8_MIN_TOKENS; the intermediate's rows past the blocks in use not quantized
              ("w8a8_by_tuned_entry", 9, 96, 64, QuantConfig("fp8", "block", (32, 32)), torch.float32,
               dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                    HALF_M=0, TMA=0, W8A8=1)),
              # bf16, the intermediate quantized by the up GEMM's epilogue (its 128-wide N tiles hold
              # whole blocks; at block 128 the cases above quantize it in a pass, at 16 x 32 and per
              # channel in the epilogue)
              ("w8a8_epilogue_bf16", 9, 256, 128, QuantConfig("fp8", "block", (128, 128)), torch.bfloat16,
               dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                    HALF_M=0, TMA=0, W8A8=1)),
              # both GEMMs' weight tiles as the MMA's wide side, the rows as its narrow one (SWAP_AB; the
              # down GEMM takes the entry's): one block scale a tile, then per-channel scales
              ("w8a8_swap_ab", 9, 256, 128, QuantConfig("fp8", "block", (128, 128)), torch.float32,
               dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                    HALF_M=0, TMA=0, W8A8=1, SWAP_AB=1)),
              ("w8a8_swap_ab_columns", 21, 96, 64, QuantConfig("compressed-tensors", "channel"), torch.float32,
               dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                    HALF_M=0, TMA=0, W8A8=1, SWAP_AB=1)),
              # the weight tiles and the down GEMM's fp8 intermediate through TMA descriptors, as loaded
              ("w8a8_tma", 9, 96, 64, QuantConfig("fp8", "block", (32, 32)), torch.float32,
               dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                    HALF_M=0, TMA=1, W8A8=1)),
              ("w8a8_tma_pass", 9, 96, 64, QuantConfig("fp8", "block", (32, 32)), torch.float32,
               dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                    HALF_M=0, TMA=1, W8A8=1)),
              # down tiles half the 64-row blocks (the intermediate's through TMA): an expert's
              # 20-40 pairs fill one or two of them, a partial one runs half height, the rest are padding
              ("w8a8_down_tiles_under_the_blocks", 75, 256, 128, QuantConfig("fp8", "block", (128, 128)),
               torch.float32,
               dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=2, num_warps=4, num_stages=2,
                    HALF_M=1, TMA=0, W8A8=1, down=dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, HALF_M=1, TMA=1)))]


def w8a8_ref(x, topk_weights, topk_ids, w13, w2, groups: tuple[int, int]) -> torch.Tensor:
    """The W8A8 GEMMs' oracle: the expert loop over the dequantized experts, computed in fp32, its
    inputs (x, then the intermediate) quantized per token and group by the torch reference and
    dequantized; gate/up, silu, the intermediate and the outputs rounded to x's dtype where the
    kernels round them."""
    import torch.nn.functional as F
    from compiled.moe.experts import expert_loop
    from compiled.quant.act_quant import dequantize_per_token_group, quantize_per_token_group_ref
    I, dt = w2.shape[2], x.dtype

    def qdq(a: torch.Tensor, group: int) -> torch.Tensor:
        return dequantize_per_token_group(*quantize_per_token_group_ref(a, group), group, torch.float32)

    def expert(e: int, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(qdq(h, groups[0]), w13[e].float()).to(dt).split(I, dim=-1)
        inter = (F.silu(gate.float()).to(dt).float() * up.float()).to(dt)
        return F.linear(qdq(inter, groups[1]), w2[e].float()).to(dt)
    return expert_loop(x, topk_weights, topk_ids, w13.shape[0], expert)


def w8a8_case(T: int, H: int, I: int, quant: QuantConfig, dtype: torch.dtype, config: dict | None = None) -> dict:
    """`fused_moe_triton` on FP8 experts above W8A8_MIN_TOKENS (lowered to T here unless `config`
    names its mode), with `config`'s tiles if given: against the oracle over the dequantized experts
    and activations (tight), and against the torch reference over the dequantized experts alone
    (loose: the activations' quantization error)."""
    from compiled.moe import fused_moe as fm
    from compiled.moe.tuned_configs import tuned_mode
    from compiled.quant.dequant import resolve_block
    E, k = 5, 2
    g = torch.Generator().manual_seed(T * H + I)
    x = torch.randn(T, H, generator=g).to(dtype)
    topk_weights, topk_ids = _routing(g, T, E, k)
    q13, s13, q2, s2, block = _fp8_experts(g, E, H, I, quant)
    w13, w2 = dequantize_blocks(q13, s13, block, torch.float32), dequantize_blocks(q2, s2, block, torch.float32)
    groups = (resolve_block(block, 2 * I, H)[1], resolve_block(block, H, I)[1])
    saved = fm.W8A8_MIN_TOKENS
    if config is None or tuned_mode(config) is None:
        fm.W8A8_MIN_TOKENS = T
    try:
        got = fm.fused_moe_triton(x, topk_weights, topk_ids, q13, q2, config=config,
                                  scales=fm.ExpertScales(s13, s2, block)).float()
    finally:
        fm.W8A8_MIN_TOKENS = saved
    want = w8a8_ref(x, topk_weights, topk_ids, w13, w2, groups).float()
    plain = fm.fused_moe_ref(x.float(), topk_weights, topk_ids, w13, w2)
    scale = plain.abs().max().item()
    loose = (got - plain).abs().max().item() / scale
    if dtype == torch.float32:
        return dict(err=(got - want).abs().max().item() / scale, tol=1e-3, loose_err=loose, loose_tol=0.06,
                    scale=scale)
    # bf16: the interpreter's bf16 stores round otherwise than torch (its bf16 Triton path over
    # bf16 experts is 2% off torch's on average), and each such difference in the intermediate can
    # move a value a whole fp8 step before the down GEMM: the loose check alone, with that margin
    return dict(err=loose, tol=0.08, loose_err=loose, loose_tol=0.08, scale=scale)


# expert LoRA over FP8 experts in W8A8 16-row tiles (the entry says so), the deltas in the epilogues
# (the intermediate quantized by the up GEMM's epilogue, whose 32-wide N tiles hold whole blocks, the
# dots weight tile x rows; then by a pass, 16-wide tiles holding half a block)
W8A8_LORA_CASES = [("w8a8_lora_block32", 9, 96, 64, QuantConfig("fp8", "block", (32, 32)),
                    dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                         HALF_M=0, TMA=0, W8A8=1, SWAP_AB=1)),
                   ("w8a8_lora_block32_pass", 9, 96, 64, QuantConfig("fp8", "block", (32, 32)),
                    dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                         HALF_M=0, TMA=0, W8A8=1)),
                   # the down delta in its own launch beside the down GEMM (`expert_lora.down_expands`), here from
                   # 0 pairs; H = 96 in 512-column programs: one partial program a token
                   ("w8a8_lora_block32_expand", 9, 96, 64, QuantConfig("fp8", "block", (32, 32)),
                    dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                         HALF_M=0, TMA=0, W8A8=1, SWAP_AB=1), True),
                   ("w8a8_lora_block32_expand_top1", 9, 96, 64, QuantConfig("fp8", "block", (32, 32)),
                    dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                         HALF_M=0, TMA=0, W8A8=1, SWAP_AB=1), True, 1)]


def w8a8_lora_case(T: int, H: int, I: int, quant: QuantConfig, config: dict, expand: bool = False,
                   top_k: int = 2) -> dict:
    """`fused_moe_lora_triton` on FP8 experts, W8A8 (fp32 activations), against a pair-by-pair
    oracle: each GEMM over the quantized-dequantized activations and the dequantized experts, its
    LoRA delta over the activations as they are (the shrinks read them unquantized). Also how far
    the same oracle without the deltas lies, so that a delta left out would fail. `expand`: the
    down delta in its own launch (`expert_lora.down_expands` from 0 pairs), and whether it ran;
    and whether the gate and up deltas were made whole beside the alignment (`gate_up_expand`).
    Summed by the op and, with top-k > 1, unsummed (`sum_slots=False`, the down deltas apart).
    Top-k 1: the down GEMM writes the output's rows, which the sum kernel adds the deltas to in
    place."""
    import torch.nn.functional as F
    from compiled.moe import expert_lora as el
    from compiled.moe import fused_moe as fm
    from compiled.quant.act_quant import dequantize_per_token_group, quantize_per_token_group_ref
    E, k = 5, top_k
    g = torch.Generator().manual_seed(T * H + I + 1)
    x = torch.randn(T, H, generator=g)
    topk_weights, topk_ids = _routing(g, T, E, k)
    q13, s13, q2, s2, block = _fp8_experts(g, E, H, I, quant)
    a13, b13, a2, b2, scale, slot = _expert_lora(g, T, E, H, I, torch.float32)
    expanded, gate_up, real = [], [], (el.DELTA_IN_K_MIN_PAIRS, el._Launches.down_expand, el.gate_up_expand)
    if expand:
        el.DELTA_IN_K_MIN_PAIRS = 0
        el._Launches.down_expand = lambda self, *a: expanded.append(real[1](self, *a))
    el.gate_up_expand = lambda *a: gate_up.append(real[2](*a))
    lora_args = (x, topk_weights, topk_ids, q13, q2, a13, b13, a2, b2, scale, slot)
    try:
        got = el.fused_moe_lora_triton(*lora_args, config=config, scales=fm.ExpertScales(s13, s2, block))
        # unsummed, as for the norm's kernel: the down deltas apart where they ran beside the GEMM
        y, d2 = el.fused_moe_lora_triton(*lora_args, config=config, scales=fm.ExpertScales(s13, s2, block),
                                         sum_slots=False) if k > 1 else (None, None)
    finally:
        el.DELTA_IN_K_MIN_PAIRS, el._Launches.down_expand, el.gate_up_expand = real
    w13, w2 = dequantize_blocks(q13, s13, block, torch.float32), dequantize_blocks(q2, s2, block, torch.float32)
    bi = quant.op_block[1]

    def qdq(a: torch.Tensor) -> torch.Tensor:
        return dequantize_per_token_group(*quantize_per_token_group_ref(a[None], bi), bi, torch.float32)[0]

    def oracle(with_delta: bool) -> torch.Tensor:
        out = torch.zeros(T, H)
        R = a2.shape[2]
        for t, j in itertools.product(range(T), range(k)):
            e, s = int(topk_ids[t, j]), int(slot[t])
            gu = w13[e] @ qdq(x[t])
            if with_delta and s >= 0:
                sa = a13[s, e] @ x[t]
                gu = gu + torch.cat([scale[s, 0] * b13[s, e, :I] @ sa[:R], scale[s, 1] * b13[s, e, I:] @ sa[R:]])
            act = F.silu(gu[:I]) * gu[I:]
            y = w2[e] @ qdq(act)
            if with_delta and s >= 0:
                y = y + scale[s, 2] * b2[s, e] @ (a2[s, e] @ act)
            out[t] += topk_weights[t, j] * y
        return out
    want, base = oracle(True), oracle(False)
    top = want.abs().max().item()
    unsummed = got if y is None else y.view(T, k, H).sum(1) + (0 if d2 is None else d2)
    err = max((got - want).abs().max().item(), (unsummed - want).abs().max().item()) / top
    calls = 2 if k > 1 else 1
    return dict(err=err, tol=1e-3, delta=(base - want).abs().max().item() / top, scale=top,
                expand_as_asked=len(expanded) == calls * int(expand) and len(gate_up) == calls
                and (d2 is not None) == (expand and k > 1))


@pytest.fixture(scope="module")
def interpreted():
    from tests.linear.test_linear_kernel import run_interpreted
    return run_interpreted(__file__)


ALL_CASES = (CASES + SKINNY_CASES + LORA_CASES + MOE_CASES + GEMV_PRELOAD_CASES + RANGE_CASES + LINEAR_RANGE_CASES
             + DEQUANT_CASES + ACT_QUANT_CASES + W8A8_CASES + W8A8_LORA_CASES + LORA_EPILOGUE_CASES)


@pytest.mark.parametrize("name", [c[0] for c in ALL_CASES])
def test_interpreted_kernel_matches_its_reference(interpreted, name):
    """Each case above against its reference within its tolerance; the MoE cases' outputs far from
    zero, the activation quantization's zero group, live rows, column-major scales and shapes,
    W8A8's loose bound too."""
    r = interpreted[name]
    assert r["err"] <= r["tol"] and r.get("scale", 1.0) > 0.1 and r.get("zero_group", True), r
    assert "delta" not in r or r["delta"] > 10 * r["tol"], r   # the LoRA deltas weigh in (W8A8 with LoRA)
    assert r.get("live_rows", True) and r.get("expand_as_asked", True) and r.get("preloaded", True), r
    assert r.get("shape") == r.get("want_shape") and r.get("loose_err", 0.0) <= r.get("loose_tol", 0.0), r


def test_w8a8_runs_only_where_it_applies():
    """W8A8 where the tuned entry says so, or where it says nothing at T >= W8A8_MIN_TOKENS, with K
    tiles inside the scale blocks of both weights; W8A16 (None) otherwise, for other blocks, and for
    bf16 experts; LoRA calls and misaligned tiles refused."""
    from compiled.moe import fused_moe as fm
    from compiled.quant.dequant import FP8_W8A8, FP8_W8A8_TILE
    E, H, I = 2, 256, 192
    w13, w2 = torch.zeros(E, 2 * I, H, dtype=torch.float8_e4m3fn), torch.zeros(E, H, I, dtype=torch.float8_e4m3fn)
    cfg = dict(BLOCK_SIZE_K=64)
    scales = fm.ExpertScales(torch.ones(E, 3, 2), torch.ones(E, 2, 2), [128, 128])
    T = fm.W8A8_MIN_TOKENS
    assert fm.w8a8_groups(scales, w13, w2, T, cfg, cfg) == (128, 128)
    assert fm.w8a8_groups(scales, w13, w2, T - 1, cfg, cfg) is None
    # the tuned entry's mode over the token count (`tuned_configs.tuned_mode`)
    assert fm.w8a8_groups(scales, w13, w2, 8, cfg, cfg, tuned=True) == (128, 128)
    assert fm.w8a8_groups(scales, w13, w2, T, cfg, cfg, tuned=False) is None
    assert fm.w8a8_groups(None, w13, w2, 8, cfg, cfg, tuned=True) is None
    assert fm.w8a8_groups(None, w13, w2, T, cfg, cfg) is None
    odd = fm.ExpertScales(torch.ones(E, 24, 11), torch.ones(E, 16, 8), [16, 24])   # K tiles of 16 straddle 24
    assert fm.w8a8_groups(odd, w13, w2, T, cfg, cfg) is None
    narrow = fm.ExpertScales(torch.ones(E, 24, 16), torch.ones(E, 16, 12), [16, 16])   # K tiles of 16: no fp8 dot
    assert fm.w8a8_groups(narrow, w13, w2, T, cfg, cfg) is None
    # one weight scale a tile where the N tiles lie inside the row blocks (w13's up half at I = 192: not)
    assert fm.fp8_kwargs(scales, "w2", w2, 64, w8a8=True, block_n=64)["FP8"] == FP8_W8A8_TILE
    assert fm.fp8_kwargs(scales, "w2", w2, 64, w8a8=True, block_n=256)["FP8"] == FP8_W8A8
    assert fm.fp8_kwargs(scales, "w13", w13, 64, w8a8=True, block_n=64)["FP8"] == FP8_W8A8
    with pytest.raises(ValueError, match="W8A8 needs K tiles of 32 or more inside the scale blocks of w13"):
        fm.fp8_kwargs(odd, "w13", w13, 16, w8a8=True)
    # a LoRA delta after the K loop goes with W8A8 (`expert_lora`); one in the K loop does not
    delta = fm.GemmDelta(*(torch.zeros(1),) * 4, consts={}, in_k=True)
    with pytest.raises(ValueError, match="launch_gemm2: a_scale .W8A8. needs FP8 experts .scales. and no LoRA delta "
                                         "in the K loop"):
        fm.launch_gemm2(w2[0], w2, None, None, None, cfg, delta=delta, scales=scales, a_scale=torch.ones(1, 2))
    with pytest.raises(ValueError, match="launch_gemm1: a_scale"):
        fm.launch_gemm1(w13[0], w13, None, None, 1, cfg, a_scale=torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"launch_gemm1: quantized_out needs BLOCK_SIZE_N \(64\) a multiple of its "
                                         r"group \(128\)"):
        fm.launch_gemm1(w13[0], w13, None, None, 1, dict(cfg, BLOCK_SIZE_N=64), scales=scales,
                        a_scale=torch.ones(1, 2), quantized_out=(w13[0], torch.ones(1, 2), 128))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 8, 64])
def test_gpu_w8a16_matches_reference_in_bf16(m):
    from compiled.linear.fp8_kernels import w8a16_linear
    quant = QuantConfig("fp8", "block", (128, 128))
    w = torch.randn(2048 + 64, 768, device="cuda")
    q, s = quantize(w, quant)
    x = torch.randn(m, 768, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), dequantize_blocks(q, s, [128, 128], torch.float32))
    assert (w8a16_linear(x, q, s, [128, 128]).float() - ref).abs().max() <= 0.05 * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 8, 16])
@pytest.mark.parametrize("N,K", [(5120, 2048), (2048, 4096)])
def test_gpu_fp8_skinny_linear_matches_dequantized_in_bf16(M, N, K):
    """The 30B's qkv and o_proj at block 128 through the op (the skinny FP8 path on CUDA)."""
    import compiled.linear.library  # noqa: F401
    q, s, block = _stacked_fp8(torch.randn(1, N, K) / K ** 0.5, QuantConfig("fp8", "block", (128, 128)))
    q, s = q[0].cuda(), s[0].cuda()
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    want = x.float() @ dequantize_blocks(q, s, block, torch.float32).T
    got = torch.ops.compiled.linear(x, q, weight_scale=s, weight_block=block).float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_cublas_w8a8_takes_only_its_recipe():
    """cuBLAS's blockwise W8A8 past the W8A16 kernel's rows, for 128 x 128 blocks, K % 512 and
    N % 128 only; other linears dequantize (or run the W8A16 kernel below its rows)."""
    from compiled.linear import W8A16_MAX_M
    from compiled.linear.fp8_cublas import recipe_fits, shape_fits
    M = W8A16_MAX_M + 1
    assert recipe_fits(5120, 2048, (128, 128), (40, 16)) and not recipe_fits(5120, 2048, (128, 128), (40, 15))
    assert shape_fits(M, 5120, 2048, (128, 128), (40, 16)) and shape_fits(2048, 2048, 4096, (128, 128), (16, 32))
    assert not shape_fits(W8A16_MAX_M, 5120, 2048, (128, 128), (40, 16))
    assert not shape_fits(M, 5120, 2048 + 128, (128, 128), (40, 17))      # K / 128 not a multiple of 4
    assert not shape_fits(M, 5120 + 64, 2048, (128, 128), (41, 16))       # a partial row block
    assert not shape_fits(M, 5120, 2048, (64, 128), (80, 16))
    assert not shape_fits(M, 5120, 2048, (1, 2048), (5120, 1))             # per channel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [257, 1000, 2048, 8192])
@pytest.mark.parametrize("N,K", [(5120, 2048), (2048, 4096)])
def test_gpu_fp8_cublas_w8a8_matches_dequantized(M, N, K):
    """The 30B's qkv and o_proj at prefill sizes through the op (cuBLAS W8A8 on Hopper): against
    the dequantized weight times the dequantized activations within bf16 rounding, and against
    the dequantized weight alone within the activations' quantization error."""
    import compiled.linear.library  # noqa: F401
    from compiled.linear import fp8 as fp8_linear
    from compiled.quant.act_quant import dequantize_per_token_group, quantize_per_token_group_ref
    from compiled.quant.dequant import WeightScale
    from compiled.triton_utils import hopper
    q, s, block = _stacked_fp8(torch.randn(1, N, K) / K ** 0.5, QuantConfig("fp8", "block", (128, 128)))
    q, s = q[0].cuda(), s[0].cuda()
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    if hopper(x.device):
        assert fp8_linear.kernel_for(x, q, WeightScale(s, block)) == "w8a8"
    w = dequantize_blocks(q, s, block, torch.float32)
    xd = dequantize_per_token_group(*quantize_per_token_group_ref(x, 128), 128, torch.float32)
    got = torch.ops.compiled.linear(x, q, weight_scale=s, weight_block=block).float()
    want, plain = xd @ w.T, x.float() @ w.T
    assert (got - want).abs().max() <= 0.01 * want.abs().max()
    assert (got - plain).abs().max() <= 0.06 * plain.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 3, 8, 16, 64, 512, 2048])
def test_gpu_fp8_moe_matches_dequantized_in_bf16(T):
    """The 30B's expert shapes at block 128: the FP8 kernels against the bf16 kernels over the
    dequantized experts; where the tuned entry for T runs W8A8, within the activations'
    quantization error too."""
    from compiled.moe import fused_moe as fm
    from compiled.moe.tuned_configs import get_config, tuned_mode
    E, H, I, k = 128, 2048, 768, 8
    quant = QuantConfig("fp8", "block", (128, 128))
    g = torch.Generator().manual_seed(T * 131)
    q13, s13, block = _stacked_fp8(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5, quant)
    q2, s2, _ = _stacked_fp8(torch.randn(E, H, I, generator=g) / I ** 0.5, quant)
    q13, s13, q2, s2 = (t.cuda() for t in (q13, s13, q2, s2))
    x = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16)
    topk_weights, topk_ids = torch.rand(T, E, generator=g).cuda().softmax(-1).topk(k)
    w13, w2 = dequantize_blocks(q13, s13, block, torch.bfloat16), dequantize_blocks(q2, s2, block, torch.bfloat16)
    want = fm.fused_moe_triton(x, topk_weights, topk_ids, w13, w2).float()
    got = fm.fused_moe_triton(x, topk_weights, topk_ids, q13, q2, scales=fm.ExpertScales(s13, s2, block)).float()
    w8a8 = fm.w8a8_entry(T, tuned_mode(get_config(T, E, I, x.dtype, x.device, fp8=True)))
    tol = 0.06 if w8a8 else 0.02
    assert (got - want).abs().max() <= tol * want.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [8, 64, 512, 2048])
def test_gpu_fp8_expert_lora_matches_dequantized_in_bf16(T):
    """Expert LoRA over the 30B's FP8 experts (8 rank-16 adapters, on the tiles and in the mode
    `expert_lora._lora_configs` picks: W8A8 where the FP8 entry is a 16-row W8A8 one, W8A16 on the
    bf16 file's tiles where it is a taller one) against the same over the dequantized experts, each
    with its own tiles; W8A8 within the activations' quantization error too."""
    from compiled.moe import expert_lora as el
    from compiled.moe import fused_moe as fm
    E, H, I, k, R, S = 128, 2048, 768, 8, 16, 8
    g = torch.Generator().manual_seed(T)
    q13, s13, q2, s2, block = _fp8_experts(g, E, H, I, QuantConfig("fp8", "block", (128, 128)))
    lora = [torch.randn(*shape, generator=g) / shape[-1] ** 0.5 for shape in
            ((S, E, 2 * R, H), (S, E, 2 * I, R), (S, E, R, I), (S, E, H, R))]
    q13, s13, q2, s2, *lora = (t.cuda() for t in (q13, s13, q2, s2, *lora))
    lora = [t.bfloat16() for t in lora]
    scale = torch.rand(S, 3, device="cuda") + 0.5
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = torch.rand(T, E, device="cuda").softmax(-1).topk(k)
    slot = torch.randint(-1, S, (T,), device="cuda", dtype=torch.int32)
    w13, w2 = dequantize_blocks(q13, s13, block, torch.bfloat16), dequantize_blocks(q2, s2, block, torch.bfloat16)
    want = el.fused_moe_lora_triton(x, topk_weights, topk_ids, w13, w2, *lora, scale, slot).float()
    scales = fm.ExpertScales(s13, s2, block)
    got = el.fused_moe_lora_triton(x, topk_weights, topk_ids, q13, q2, *lora, scale, slot, scales=scales).float()
    w8a8 = el._lora_configs(T, E, I, x, None, scales, q13, q2)[2] is not None
    assert (got - want).abs().max() <= (0.06 if w8a8 else 0.02) * want.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T, lora", [(8, False), (20, False), (64, False), (300, False), (8, True), (20, True),
                                     (64, True)])
def test_gpu_fp8_moe_norm_linear_quantizes_in_the_norm(T, lora):
    """The MoE, its top-k sum + norm and the next layer's qkv as one op, 30B shapes, FP8 experts
    and qkv: where qkv runs W8A8 (the W8A16 kernel's swapped fp8 tiles at 8 and 20 rows, its
    plain ones at 64, cuBLAS at 300) the
    norm's kernel quantizes its input, beside the qkv's LoRA shrink where qkv has adapters (4
    slots of rank 16, some rows without). Against the op over the dequantized weights, within the
    activations' quantization error."""
    import compiled.fusions.moe_norm_linear  # noqa: F401  (registers the op)
    from compiled.linear import fp8 as fp8_linear
    from compiled.quant.dequant import WeightScale
    from compiled.triton_utils import hopper
    E, H, I, k, N = 128, 2048, 768, 8, 5120
    g = torch.Generator().manual_seed(T)
    quant = QuantConfig("fp8", "block", (128, 128))
    q13, s13, q2, s2, block = _fp8_experts(g, E, H, I, quant)
    qw, sw, _ = _stacked_fp8(torch.randn(1, N, H, generator=g) / H ** 0.5, quant)
    q13, s13, q2, s2, qw, sw = (t.cuda() for t in (q13, s13, q2, s2, qw[0], sw[0]))
    x, x_moe = (torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    nw = 1 + 0.1 * torch.randn(H, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = torch.rand(T, E, device="cuda").softmax(-1).topk(k)
    if hopper(x.device):
        assert fp8_linear.input_buffers(x, qw, WeightScale(sw, block)) is not None
    own = {}
    if lora:
        S, R, slices = 4, 16, [4096, 512, 512]
        own = dict(lora_a=torch.randn(S, 3 * R, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5,
                   lora_b=torch.randn(S, N, R, device="cuda", dtype=torch.bfloat16) / R ** 0.5,
                   lora_scale=torch.rand(S, 3, device="cuda") + 0.5, lora_slices=slices,
                   lora_slot=torch.randint(-1, S, (T,), device="cuda", dtype=torch.int32))
    got = torch.ops.compiled.moe_add_rms_norm_linear(x, x_moe, topk_weights, topk_ids, q13, q2, nw, 1e-6, qw, True,
                                                     weight_scale=sw, w13_scale=s13, w2_scale=s2, weight_block=block,
                                                     **own)
    deq = [dequantize_blocks(q, s, block, torch.bfloat16) for q, s in ((q13, s13), (q2, s2), (qw, sw))]
    want = torch.ops.compiled.moe_add_rms_norm_linear(x, x_moe, topk_weights, topk_ids, deq[0], deq[1], nw, 1e-6,
                                                      deq[2], True, **own)
    for a, b, tol in zip(got, want, (0.06, 0.02, 0.02)):
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()


if __name__ == "__main__":   # run by the fixture above under TRITON_INTERPRET=1
    os.environ.setdefault("COMPILED_LINEAR_BACKEND", "auto")
    results = {name: kernel_case(M, N, K, quant) for name, M, N, K, quant in CASES}
    results.update({name: moe_case(T, quant, dtype, lora) for name, T, quant, dtype, lora in MOE_CASES})
    results.update({name: gemv_preload_case(quant) for name, quant in GEMV_PRELOAD_CASES})
    results.update({name: moe_range_case(scales) for name, scales in RANGE_CASES})
    results.update({name: linear_range_case(scales) for name, scales in LINEAR_RANGE_CASES})
    results.update({name: skinny_case(M, config, quant) for name, M, config, quant in SKINNY_CASES})
    results.update({name: lora_case(M) for name, M in LORA_CASES})
    results.update({name: dequant_case(*case) for name, *case in DEQUANT_CASES})
    results.update({name: act_quant_case(*case) for name, *case in ACT_QUANT_CASES})
    results.update({name: w8a8_case(*case) for name, *case in W8A8_CASES})
    results.update({name: w8a8_lora_case(*case) for name, *case in W8A8_LORA_CASES})
    results.update({name: lora_epilogue_case(*case) for name, *case in LORA_EPILOGUE_CASES})
    print(json.dumps(results))
