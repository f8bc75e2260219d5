"""The bodies of the linears that do the step before them, `compiled::add_rms_norm_linear` and
`compiled::silu_mul_linear`, without their optional operands (`library.py` registers the ops).

At decode sizes the residual add + RMSNorm in front of a linear, or the SiLU-and-mul in front of
the down projection, is a launch of its own that moves a few kilobytes. The skinny GEMM does it in
its prologue instead (`skinny_kernels`: ADD_NORM, SILU_MUL), so the fuse_norm_linear and fuse_silu_linear
passes route the graph's matching pairs here. The kernel serves what it serves for
`compiled::linear` (`use_kernel`: up to `max_rows` on CUDA in bf16/fp16, where it beats cuBLAS,
under the same backend switch; one row always, in its GEMV mode): there the prologue costs less
than the launch it saves (H100, bench/RESULTS.md), while at 2-16 rows in front of a linear that
cuBLAS does better (the 30B shape's qkv) it cost more. Elsewhere the prologue runs as one launch
of its own (`prologue_kernels`) before F.linear, as Inductor's kernel did; CPU runs the torch
references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiled.functional import add_rms_norm_ref, silu_and_mul_ref
from compiled.linear.ops import BACKEND, check_shapes, use_kernel


def add_rms_norm_linear_ref(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, normed) with y = F.linear(normed, weight)."""
    h, normed = add_rms_norm_ref(x, delta, norm_weight, eps)
    return F.linear(normed, weight), h, normed


def silu_mul_linear_ref(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(silu_and_mul_ref(gate_up), weight)


def check_norm(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
               op: str = "compiled::add_rms_norm_linear", delta_name: str = "delta") -> None:
    """One-line errors naming `op` and the argument at fault; `delta_name`: what the op calls the
    tensor shaped like x (the MoE op takes the experts' input there)."""
    check_shapes(x, weight)
    if x.dim() != 2:
        raise ValueError(f"{op}: x {tuple(x.shape)}, expected [T, K]")
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(f"{op}: {delta_name} {tuple(delta.shape)} {delta.dtype} "
                         f"does not match x {tuple(x.shape)} {x.dtype}")
    if norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"{op}: norm weight {tuple(norm_weight.shape)}, expected ({x.shape[-1]},)")


def add_rms_norm_linear(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, keep_normed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, delta `[T, K]` -> (y `[T, N]`, h = x + delta, normed = RMSNorm(h) or an empty tensor when
    not keep_normed). h is what the residual stream carries on; normed is for other readers."""
    check_norm(x, delta, norm_weight, weight)
    if use_kernel(x, weight) and delta.stride(-1) == 1:
        from compiled.linear.skinny_kernels import add_rms_norm_linear_triton
        y, h, normed = add_rms_norm_linear_triton(x, delta, norm_weight, eps, weight, keep_normed)
    else:
        h, normed = add_rms_norm(x, delta, norm_weight, eps)
        y = F.linear(normed, weight)
    return y, h, normed if keep_normed else x.new_empty(0)


def own_launch(*tensors: torch.Tensor) -> bool:
    """Whether a prologue outside the skinny kernel runs as its Triton launch (CUDA, last dims
    contiguous, not the 'torch' backend) rather than as the reference's eager ops."""
    return BACKEND.name != "torch" and all(t.is_cuda and t.stride(-1) == 1 for t in tensors)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = x + delta, RMSNorm(h) * norm_weight): the prologue alone, as its own launch where
    `own_launch` says so."""
    if own_launch(x, delta):
        from compiled.linear.prologue_kernels import add_rms_norm_triton
        return add_rms_norm_triton(x, delta, norm_weight, eps)
    return add_rms_norm_ref(x, delta, norm_weight, eps)


def check_silu(gate_up: torch.Tensor, weight: torch.Tensor, op: str = "compiled::silu_mul_linear") -> None:
    if gate_up.dim() != 2 or weight.dim() != 2 or gate_up.shape[-1] != 2 * weight.shape[1]:
        raise ValueError(f"{op}: gate_up {tuple(gate_up.shape)} @ weight "
                         f"{tuple(weight.shape)}.T: expected gate_up [T, 2K] and weight [N, K]")
    if gate_up.dtype != weight.dtype:
        raise ValueError(f"{op}: gate_up is {gate_up.dtype}, weight is {weight.dtype}")


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T for gate_up `[T, 2K]` = [gate | up]."""
    check_silu(gate_up, weight)
    if use_kernel(gate_up[:, :weight.shape[1]], weight):
        from compiled.linear.skinny_kernels import silu_mul_linear_triton
        return silu_mul_linear_triton(gate_up, weight)
    return F.linear(silu_and_mul(gate_up), weight)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The activation alone: its Triton launch where `own_launch` says so, the reference otherwise."""
    if own_launch(gate_up):
        from compiled.linear.prologue_kernels import silu_and_mul_triton
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up)
