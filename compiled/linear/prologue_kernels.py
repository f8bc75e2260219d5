"""The fused linears' prologues as launches of their own (Triton), for what the skinny GEMM does not
take (prefill, larger batches, linears that cuBLAS does better).

`compiled::add_rms_norm_linear` and `compiled::silu_mul_linear` run these and then F.linear
there: one launch each, as the Inductor kernels they replace were, instead of the reference's
eager ops. The prologues' arithmetic is `triton_utils`' jit helpers, rounded where torch rounds
it; the skinny GEMM's prologues (`skinny_kernels`) call the same ones. The torch references are
`functional.add_rms_norm_ref` and `functional.silu_and_mul_ref`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiled.linear.lora_kernels import LoRAArgs, row_delta_added
from compiled.triton_utils import add_rms_norm_row, launch_kwargs, pdl_wait, row_warps, silu_mul

ROW_DELTA_R_STEP = 4   # ranks of B a step in the norm's LoRA delta: a 2,048-column row's B tile stays in registers


@triton.jit
def _add_rms_norm_kernel(X, D, NW, H, NORMED, K, eps, stride_xm, stride_dm, SIN, B, SCALE, SLOT, R, S, stride_st,
                         stride_bs, stride_bo, stride_ss, BLOCK: tl.constexpr, LORA: tl.constexpr,
                         BLOCK_R: tl.constexpr, R_STEP: tl.constexpr, LOW_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """LORA: D is a one-slice linear's base output; its rows get their LoRA deltas (the expand's
    arithmetic, `row_delta_added`) before the add."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(X + row * stride_xm + cols, mask=mask, other=0.0)
    d = tl.load(D + row * stride_dm + cols, mask=mask, other=0.0)
    if LORA:
        d = row_delta_added(d, SIN, B, SCALE, SLOT, row, cols, mask, R, S, stride_st, stride_bs, stride_bo, stride_ss,
                            BLOCK_R, R_STEP, LOW_PRECISION)
    add_rms_norm_row(x, d, NW, H + row * K, NORMED + row * K, cols, mask, K, eps)


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        lora: LoRAArgs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = x + delta, RMSNorm(h) * norm_weight) for x, delta `[T, K]` (last dims contiguous).
    `lora` (one slice of K columns): delta is a linear's base output and gets that linear's LoRA
    deltas first, rounded as `lora_expand` rounds them."""
    T, K = x.shape
    h, normed = x.new_empty((T, K)), x.new_empty((T, K))
    if T:
        block = triton.next_power_of_2(K)
        la = dict(SIN=x, B=x, SCALE=x, SLOT=x, R=0, S=0, stride_st=0, stride_bs=0, stride_bo=0, stride_ss=0,
                  LORA=False, BLOCK_R=1, R_STEP=1, LOW_PRECISION=False)
        if lora is not None:
            if lora.n_slices != 1 or lora.b.shape[1] != K:
                raise ValueError(f"add_rms_norm_triton: LoRA b {tuple(lora.b.shape)} with {lora.n_slices} slices, "
                                 f"expected one slice of {K} columns")
            la.update(SIN=lora.s, B=lora.b, SCALE=lora.scale, SLOT=lora.slot, R=lora.b.shape[2], S=lora.b.shape[0],
                      stride_st=lora.s.stride(0), stride_bs=lora.b.stride(0), stride_bo=lora.b.stride(1),
                      stride_ss=lora.scale.stride(0), LORA=True, BLOCK_R=lora.block_r,
                      R_STEP=min(lora.block_r, ROW_DELTA_R_STEP), LOW_PRECISION=not lora.fp32_dot)
        _add_rms_norm_kernel[(T,)](x, delta, norm_weight, h, normed, K, eps, x.stride(0), delta.stride(0), **la,
                                   BLOCK=block, num_warps=row_warps(block), **launch_kwargs(x.device))
    return h, normed


@triton.jit
def _silu_mul_kernel(X, Y, I, stride_xm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(X + row * stride_xm + cols, mask=mask, other=0.0)
    u = tl.load(X + row * stride_xm + I + cols, mask=mask, other=0.0)
    tl.store(Y + row * I + cols, silu_mul(g, u), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up `[T, 2I]` = [gate | up] (last dim contiguous) -> `[T, I]`."""
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((T, I))
    if T:
        block = min(1024, triton.next_power_of_2(I))
        _silu_mul_kernel[(T, triton.cdiv(I, block))](gate_up, out, I, gate_up.stride(0), BLOCK=block, num_warps=4)
    return out
