"""Prefill-sized FP8 linears on cuBLAS's FP8 tensor cores (W8A8): the activations quantized per
token in groups of 128 (`quant.act_quant`), then one blockwise-scaled GEMM (torch's `scaled_mm`,
1 x 128 activation groups by the weight's 128 x 128 blocks, fp32 accumulation), so the weight is
read as FP8 and never dequantized into a bf16 copy.

cuBLAS takes this recipe on Hopper only, with 128 x 128 weight blocks, K a multiple of 512 (its
scale grid's K side padded to 4, which these shapes need no padding for) and N of 128; `fits`
says where, and other linears dequantize as before. The torch reference is the dequantized
weight times the dequantized activations (`act_quant.dequantize_per_token_group`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import compiled.envs as envs
from compiled.linear import W8A16_MAX_M
from compiled.quant.act_quant import FP8, QuantizedRows, quantize_per_token_group
from compiled.quant.dequant import WeightScale, resolve_block
from compiled.triton_utils import hopper

GROUP = 128   # the recipe's activation group and weight block side
# torch's cuBLASLt workspace (KiB; read at the process's first cuBLASLt call) where FP8 linears run
# here. With a workspace, the blockwise GEMMs of the 30B's qkv at prefill sizes take dynamically
# scheduled kernels that zero a tile counter before each call: a memset node and an idle gap before
# every one in a captured prefill. Without, statically scheduled ones, and those are faster too
# (H200, bench/RESULTS.md).
WORKSPACE_KIB = 0
# cuBLAS refuses the recipe for row counts that are not a multiple of this (257 is refused; the
# activations are padded to it)
ROW_ALIGN = 16


def recipe_fits(N: int, K: int, block: tuple[int, int], scale_shape: tuple[int, ...]) -> bool:
    """Whether an `[N, K]` FP8 weight with `block` (resolved) and a scale of `scale_shape` is one
    cuBLAS multiplies blockwise: 128 x 128 blocks, K % 512 == 0, N % 128 == 0."""
    return (tuple(block) == (GROUP, GROUP) and K % (4 * GROUP) == 0 and N % GROUP == 0
            and tuple(scale_shape) == (N // GROUP, K // GROUP))


def shape_fits(M: int, N: int, K: int, block: tuple[int, int], scale_shape: tuple[int, ...]) -> bool:
    """`recipe_fits`, for `M` rows past the W8A16 kernel's."""
    return M > W8A16_MAX_M and recipe_fits(N, K, block, scale_shape)


def fits(x: torch.Tensor, weight: torch.Tensor, fp8: WeightScale) -> bool:
    """`shape_fits` for x @ weight.T on a Hopper GPU, x in 16 bits with contiguous rows."""
    N, K = weight.shape
    return (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1
            and weight.is_contiguous() and hopper(x.device)
            and shape_fits(x.shape[0], N, K, resolve_block(list(fp8.block), N, K), fp8.scale.shape))


def prefer_static_schedules() -> None:
    """Ask torch for no cuBLASLt workspace (WORKSPACE_KIB) unless CUBLASLT_WORKSPACE_SIZE is set:
    for a process about to run these GEMMs, before its first cuBLASLt call (after it, torch keeps
    the size it read). Its child processes inherit the setting."""
    if not envs.is_set("CUBLASLT_WORKSPACE_SIZE"):
        envs.set_for_children("CUBLASLT_WORKSPACE_SIZE", str(WORKSPACE_KIB))


def act_buffers(x: torch.Tensor) -> QuantizedRows:
    """Where x `[M, K]` quantized goes for `w8a8_linear`: rows padded to ROW_ALIGN, the scales
    column-major (cuBLAS reads them so: a `[G, rows]` buffer seen as `[rows, G]`). The padding
    rows are never written, and their outputs are cut off."""
    M, K = x.shape
    rows = -(-M // ROW_ALIGN) * ROW_ALIGN
    return QuantizedRows(torch.empty(rows, K, dtype=FP8, device=x.device),
                         torch.empty(K // GROUP, rows, dtype=torch.float32, device=x.device).t(), GROUP)


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                quantized: QuantizedRows | None = None) -> torch.Tensor:
    """x `[M, K]` @ weight.T (weight `[N, K]` float8_e4m3fn, block scale `[N/128, K/128]`) in x's
    dtype, where `fits` holds. `quantized`: x already quantized into `act_buffers(x)`."""
    M = x.shape[0]
    if quantized is None:
        quantized = act_buffers(x)
        quantize_per_token_group(x, GROUP, out=quantized.q[:M], scale_out=quantized.s[:M])
    xq, xs = quantized.q, quantized.s
    ws = scale if scale.dtype == torch.float32 else scale.float()
    y = F.scaled_mm(xq, weight.t(), xs, F.ScalingType.BlockWise1x128, ws.contiguous().t(),
                    F.ScalingType.BlockWise128x128, output_dtype=x.dtype)
    return y[:M]
