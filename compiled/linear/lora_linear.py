"""Linears with their multi-LoRA deltas inside: `compiled::linear_lora` and its prologue forms.

Each op is `lora_expand(linear(x', W), lora_shrink(x', a, slot), b, scale, slot, slices)` for
the linear's input x' (the ops of `lora.py`; the fuse passes build these from the pairs
lora_delta makes):

    linear_lora(x, W, a, b, scale, slot, slices)                                x' = x
    add_rms_norm_linear_lora(x, delta, norm_w, eps, W, keep_normed, a, ...)     x' = RMSNorm(x + delta)
    silu_mul_linear_lora(gate_up, W, a, ...)                                    x' = silu(gate) * up

`add_rms_norm_linear_lora` returns (y, h, normed) as `add_rms_norm_linear` does. At one decode
row (the skinny GEMM's GEMV mode) each is one launch: the prologue, the GEMV, the shrink (its few
columns done by the launch's first programs) and the expand in the epilogue, so an adapter's
delta adds no launch. At 2-16 rows where the skinny GEMM serves `linear_lora`, the shrink's launch
comes first and the GEMM adds the deltas in its epilogue; the prologue forms, and every size the
skinny GEMM does not serve, run the three ops' bodies in turn."""

from __future__ import annotations

import torch

from compiled.linear import LORA_MAX_SLICES, fused, lora, ops
from compiled.linear.lora import check_expand, check_shrink, expand, shrink


def _in_kernel(x: torch.Tensor, weight: torch.Tensor, slices: list[int]) -> bool:
    """Whether the skinny GEMM adds the deltas (both backends allow kernels, it serves the linear)."""
    return lora.use_kernel(x) and len(slices) <= LORA_MAX_SLICES and ops.use_kernel(x, weight)


def _one_launch(x: torch.Tensor, weight: torch.Tensor, slices: list[int], prologue: bool) -> bool:
    from compiled.linear.skinny_kernels import computes_shrink
    return _in_kernel(x, weight, slices) and computes_shrink(x.shape[0], *weight.shape, x.device, prologue)


def _args(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slot: torch.Tensor,
          slices: list[int], s: torch.Tensor | None = None):
    """The launch's LoRA arguments; without `s`, a buffer the launch writes the shrink into."""
    from compiled.linear.lora_kernels import LoRAArgs
    if s is None:
        s = torch.empty((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    return LoRAArgs.of(s, b, scale, slot, list(slices))


def check_lora(op: str, x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               scale: torch.Tensor, slot: torch.Tensor, slices: list[int]) -> None:
    """One-line errors naming `op` and the tensor at fault; x is the linear's input as the
    shrink reads it (`[T, K]`)."""
    ops.check_shapes(x, weight)
    if x.dim() != 2:
        raise ValueError(f"{op}: x {tuple(x.shape)}, expected [T, K]")
    check_shrink(x, a, slot)
    if b.dim() == 3 and a.shape[1] != len(slices) * b.shape[2]:
        raise ValueError(f"{op}: a {tuple(a.shape)} has {a.shape[1]} rows, expected {len(slices)} slices x "
                         f"rank {b.shape[2]} (b {tuple(b.shape)})")
    T = x.shape[0]
    check_expand(x.new_empty(()).expand(T, weight.shape[0]), x.new_empty((), dtype=torch.float32).expand(
        T, a.shape[1]), b, scale, slot, slices)


@torch.library.custom_op("compiled::linear_lora", mutates_args=())
def linear_lora(x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                slot: torch.Tensor, slices: list[int]) -> torch.Tensor:
    """`x @ weight.T` plus each row's LoRA delta (`lora_shrink` by a, `lora_expand` by b), rounded
    as the two ops round. A linear that cuBLAS does better (the 30B's qkv at 2-16 rows) lost more
    in the skinny GEMM than the expand's launch saved (bench/RESULTS.md): there the ops' bodies run."""
    check_lora("compiled::linear_lora", x, weight, a, b, scale, slot, slices)
    if _one_launch(x, weight, slices, prologue=False):
        from compiled.linear.skinny_kernels import skinny_linear_lora_triton
        return skinny_linear_lora_triton(x, weight, _args(x, a, b, scale, slot, slices), shrink_a=a)
    s = shrink(x, a, slot)
    if _in_kernel(x, weight, slices):
        from compiled.linear.skinny_kernels import skinny_linear_lora_triton
        return skinny_linear_lora_triton(x, weight, _args(x, a, b, scale, slot, slices, s))
    return expand(ops.dispatch(x, weight), s, b, scale, slot, slices)


@linear_lora.register_fake
def _(x, weight, a, b, scale, slot, slices):
    check_lora("compiled::linear_lora", x, weight, a, b, scale, slot, slices)
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("compiled::add_rms_norm_linear_lora", mutates_args=())
def add_rms_norm_linear_lora(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             weight: torch.Tensor, keep_normed: bool, a: torch.Tensor, b: torch.Tensor,
                             scale: torch.Tensor, slot: torch.Tensor, slices: list[int]
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm_linear` whose y has the LoRA deltas of its input, normed."""
    _check_norm_lora(x, delta, norm_weight, weight, a, b, scale, slot, slices)
    if delta.stride(-1) == 1 and _one_launch(x, weight, slices, prologue=True):
        from compiled.linear.skinny_kernels import add_rms_norm_linear_triton
        y, h, normed = add_rms_norm_linear_triton(x, delta, norm_weight, eps, weight, keep_normed,
                                                  lora=_args(x, a, b, scale, slot, slices), shrink_a=a)
    else:
        y, h, normed = fused.add_rms_norm_linear(x, delta, norm_weight, eps, weight, True)
        y = expand(y, shrink(normed, a, slot), b, scale, slot, slices)
    return y, h, normed if keep_normed else x.new_empty(0)


def _check_norm_lora(x, delta, norm_weight, weight, a, b, scale, slot, slices) -> None:
    op = "compiled::add_rms_norm_linear_lora"
    fused.check_norm(x, delta, norm_weight, weight, op)
    check_lora(op, x, weight, a, b, scale, slot, slices)


@add_rms_norm_linear_lora.register_fake
def _(x, delta, norm_weight, eps, weight, keep_normed, a, b, scale, slot, slices):
    _check_norm_lora(x, delta, norm_weight, weight, a, b, scale, slot, slices)
    return x.new_empty((x.shape[0], weight.shape[0])), torch.empty_like(x), \
        torch.empty_like(x) if keep_normed else x.new_empty(0)


@torch.library.custom_op("compiled::silu_mul_linear_lora", mutates_args=())
def silu_mul_linear_lora(gate_up: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         scale: torch.Tensor, slot: torch.Tensor, slices: list[int]) -> torch.Tensor:
    """`silu_mul_linear` plus the LoRA deltas of its input, silu(gate) * up."""
    _check_silu_lora(gate_up, weight, a, b, scale, slot, slices)
    K = weight.shape[1]
    if _one_launch(gate_up[:, :K], weight, slices, prologue=True):
        from compiled.linear.skinny_kernels import silu_mul_linear_triton
        return silu_mul_linear_triton(gate_up, weight, lora=_args(gate_up, a, b, scale, slot, slices), shrink_a=a)
    return linear_lora(fused.silu_and_mul(gate_up), weight, a, b, scale, slot, slices)


def _check_silu_lora(gate_up, weight, a, b, scale, slot, slices) -> None:
    fused.check_silu(gate_up, weight, "compiled::silu_mul_linear_lora")
    check_lora("compiled::silu_mul_linear_lora", gate_up[:, :weight.shape[1]], weight, a, b, scale, slot, slices)


@silu_mul_linear_lora.register_fake
def _(gate_up, weight, a, b, scale, slot, slices):
    _check_silu_lora(gate_up, weight, a, b, scale, slot, slices)
    return gate_up.new_empty((gate_up.shape[0], weight.shape[0]))
