"""Where an FP8 linear runs: which kernel reads the float8_e4m3fn bytes for x @ W.T, or the
dequantized weight where none does (prefill shapes cuBLAS's FP8 GEMM does not take, the CPU:
the torch reference).

`WeightScale` carries an FP8 weight's block scale beside the weight through the linear bodies
(plain, fused, LoRA); `linear`, `add_rms_norm_linear` and `silu_mul_linear` are the family's
bodies without LoRA, for a weight in the activations' dtype or an FP8 one."""

from __future__ import annotations

import torch

from compiled.linear import W8A16_MAX_M, fp8_cublas, fused, ops
from compiled.linear.lora_kernels import LoRAArgs
from compiled.quant.act_quant import FP8, QuantizedRows, row_quantizable
from compiled.quant.dequant import WeightScale, dequantize_blocks


def kernel_for(x: torch.Tensor, weight: torch.Tensor, fp8: WeightScale | None, quantized: bool = False) -> str | None:
    """The kernel that reads the FP8 weight's bytes for x @ weight.T: 'skinny' (a few rows,
    `ops.use_kernel`), 'w8a16' (up to W8A16_MAX_M rows on CUDA, any under the forced 'triton'
    backend), 'w8a8' (more rows, on cuBLAS where `fp8_cublas.fits`), or None: not FP8, or
    computed with the dequantized weight. `quantized`: x arrives quantized by the kernel in front
    (`input_buffers`), which makes the W8A16 kernel's swapped W8A8 tiles the choice at the rows
    of `fp8_kernels.swap_rows`."""
    if fp8 is None or x.dim() != 2:
        return None
    backend = ops.BACKEND.name
    on_kernels = x.is_cuda and x.dtype in ops.KERNEL_DTYPES
    if quantized and backend == "auto" and on_kernels:
        from compiled.linear.fp8_kernels import swap_rows
        if swap_rows(x.shape[0], x.device):
            return "w8a16"
    if ops.use_kernel(x, weight, fp8=True):
        return "skinny"
    if backend == "triton" or (backend == "auto" and on_kernels and x.shape[0] <= W8A16_MAX_M):
        return "w8a16"
    if backend == "auto" and fp8_cublas.fits(x, weight, fp8):
        return "w8a8"
    return None


def lora_in_epilogue(x: torch.Tensor, weight: torch.Tensor, fp8: WeightScale | None, quantized: bool = False) -> bool:
    """Whether the kernel for x @ weight.T adds LoRA deltas in its epilogue (`linear`'s `lora`):
    the W8A16 kernel where its config runs one K split (the skinny GEMM has its own LoRA bodies)."""
    if kernel_for(x, weight, fp8, quantized) != "w8a16":
        return False
    from compiled.linear.fp8_kernels import lora_in_epilogue as one_split
    return one_split(x, weight, fp8.block, quantized)


def dequantized(weight: torch.Tensor, fp8: WeightScale | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype` (itself when not FP8): on CUDA in one Triton pass, else the reference."""
    if fp8 is None:
        return weight
    if weight.is_cuda:
        from compiled.quant.dequant_kernel import dequantize_triton
        return dequantize_triton(weight, fp8.scale, fp8.block, dtype)
    return dequantize_blocks(weight, fp8.scale, fp8.block, dtype)


def stand_in(weight: torch.Tensor, fp8: WeightScale | None, dtype: torch.dtype) -> torch.Tensor:
    """What the shape and dtype checks of the linear bodies see: the weight, or for an FP8 one a
    view of its shape in `dtype` (no memory)."""
    return weight if fp8 is None else torch.empty((), dtype=dtype, device=weight.device).expand(weight.shape)


def input_buffers(x: torch.Tensor, weight: torch.Tensor, fp8: WeightScale | None) -> QuantizedRows | None:
    """Where the kernel for x @ weight.T (`kernel_for`) quantizes x first (W8A8: cuBLAS's, or the
    W8A16 kernel's fp8 tiles), empty buffers in the layout it reads them, for the kernel in front
    of the linear to fill as `quantize_row` does (its groups a power of two); else None."""
    kernel = kernel_for(x, weight, fp8, quantized=True)
    if kernel == "w8a8":
        return fp8_cublas.act_buffers(x)
    if kernel != "w8a16":
        return None
    from compiled.linear.fp8_kernels import a8_group
    M, K = x.shape
    group = a8_group(x, weight, fp8.block, quantized=True)
    if not row_quantizable(K, group):
        return None
    return QuantizedRows(torch.empty(M, K, dtype=FP8, device=x.device),
                         torch.empty(M, -(-K // group), dtype=torch.float32, device=x.device), group)


def linear(x: torch.Tensor, weight: torch.Tensor, fp8: WeightScale | None = None,
           quantized: QuantizedRows | None = None, lora: LoRAArgs | None = None) -> torch.Tensor:
    """x @ weight.T: `ops.dispatch`'s for a weight in x's dtype; an FP8 one (`fp8`) through the
    kernel `kernel_for` names, else dequantized. `quantized`: x already quantized into
    `input_buffers(x, weight, fp8)`. `lora`: the rows' LoRA deltas added in the FP8 kernel's
    epilogue, where `lora_in_epilogue` says it takes them (else a one-line error: here for another
    kernel, in `w8a16_linear` for a split config)."""
    if fp8 is not None:
        ops.check_shapes(x, stand_in(weight, fp8, x.dtype))
    kernel = kernel_for(x, weight, fp8, quantized is not None)
    if lora is not None and kernel != "w8a16":
        raise ValueError(f"fp8 linear: no LoRA epilogue for x {tuple(x.shape)} @ weight {tuple(weight.shape)}")
    if kernel == "skinny":
        from compiled.linear.skinny_kernels import skinny_linear_triton
        return skinny_linear_triton(x, weight, fp8=fp8)
    if kernel == "w8a16":
        from compiled.linear.fp8_kernels import w8a16_linear
        return w8a16_linear(x, weight, fp8.scale, fp8.block, quantized=quantized, lora=lora)
    if kernel == "w8a8":
        return fp8_cublas.w8a8_linear(x, weight, fp8.scale, quantized)
    return ops.dispatch(x, dequantized(weight, fp8, x.dtype))


def add_rms_norm_linear(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, keep_normed: bool, fp8: WeightScale | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fused.add_rms_norm_linear`, the weight FP8 where `fp8` is given: the skinny GEMM with the
    norm as its prologue, or the norm's own launch and then `linear`."""
    if fp8 is None:
        return fused.add_rms_norm_linear(x, delta, norm_weight, eps, weight, keep_normed)
    fused.check_norm(x, delta, norm_weight, stand_in(weight, fp8, x.dtype))
    if kernel_for(x, weight, fp8) == "skinny" and delta.stride(-1) == 1:
        from compiled.linear.skinny_kernels import add_rms_norm_linear_triton
        y, h, normed = add_rms_norm_linear_triton(x, delta, norm_weight, eps, weight, keep_normed, fp8=fp8)
    else:
        h, normed = fused.add_rms_norm(x, delta, norm_weight, eps)
        y = linear(normed, weight, fp8)
    return y, h, normed if keep_normed else x.new_empty(0)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, fp8: WeightScale | None = None) -> torch.Tensor:
    """`fused.silu_mul_linear`, the weight FP8 where `fp8` is given (as `add_rms_norm_linear`)."""
    if fp8 is None:
        return fused.silu_mul_linear(gate_up, weight)
    fused.check_silu(gate_up, stand_in(weight, fp8, gate_up.dtype))
    if kernel_for(gate_up[:, :weight.shape[1]], weight, fp8) == "skinny":
        from compiled.linear.skinny_kernels import silu_mul_linear_triton
        return silu_mul_linear_triton(gate_up, weight, fp8=fp8)
    return linear(fused.silu_and_mul(gate_up), weight, fp8)
