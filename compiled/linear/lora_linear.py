"""The LoRA bodies of the linear family's ops (`library.py` registers the ops and calls these
where the LoRA operands are given).

Each is `lora_expand(linear(x', W), lora_shrink(x', a, slot), b, scale, slot, slices)` for the
linear's input x' (the ops of `lora.py`):

    linear_lora(x, W, a, b, scale, slot, slices)                                x' = x
    add_rms_norm_linear_lora(x, delta, norm_w, eps, W, keep_normed, a, ...)     x' = RMSNorm(x + delta)
    silu_mul_linear_lora(gate_up, W, a, ...)                                    x' = silu(gate) * up

`add_rms_norm_linear_lora` returns (y, h, normed) as `add_rms_norm_linear` does. Where the skinny
GEMM serves the linear, a body is two launches: the shrink (at one row in its GEMV mode, doing
the prologue itself from the op's inputs), then the skinny GEMM with the prologue and the
expand in its epilogue. So a decode row's delta costs one short launch a linear, not the shrink,
the expand and, for the prologue forms, the prologue's own launch. A prologue form above one
row, and every size the skinny GEMM does not serve, runs the three ops' bodies; `linear_lora`'s
shrink, which reads x as it comes, runs on a side stream beside the base GEMM (`side_stream`:
H100, 30B at 64 rows, o_proj's delta +9.7 -> +6.9 µs). A linear that cuBLAS does better (the
30B's qkv at 2-16 rows) lost more in the skinny GEMM than the expand's launch saved
(bench/RESULTS.md).

`linear_lora_add_rms_norm_linear(x, inp, W_in, a, b, scale, slot, norm_w, eps, W, keep_normed)`
is `add_rms_norm_linear(x, linear_lora(inp, W_in, ...), norm_w, eps, W, keep_normed)` for a
one-slice linear (o_proj before the post-attention norm and the router: `add_rms_norm_linear`
with `delta_weight` and its LoRA): at 17-64 rows the norm's launch adds the deltas and the
expand's own launch goes."""

from __future__ import annotations

import torch

from compiled.linear import LORA_MAX_SLICES, NORM_LORA_MAX_T, SKINNY_MAX_M, fused, lora, ops
from compiled.linear import fp8 as fp8_linear
from compiled.linear.fp8 import stand_in
from compiled.linear.lora import check_expand, check_shrink, expand, shrink
from compiled.quant.act_quant import QuantizedRows
from compiled.quant.dequant import WeightScale
from compiled.side_stream import Fork


def _kernels_take(x: torch.Tensor, slices: list[int]) -> bool:
    """Whether a kernel's epilogue may add the deltas: the LoRA backend allows kernels, and the
    slices are few enough for them."""
    return lora.use_kernel(x) and len(slices) <= LORA_MAX_SLICES


def _in_kernel(x: torch.Tensor, weight: torch.Tensor, slices: list[int], fp8: WeightScale | None = None) -> bool:
    """Whether the skinny GEMM adds the deltas (both backends allow kernels, it serves the linear)."""
    return _kernels_take(x, slices) and ops.use_kernel(x, weight, fp8 is not None)


def _prologue_in_shrink(x: torch.Tensor, weight: torch.Tensor, slices: list[int],
                        fp8: WeightScale | None = None) -> bool:
    """Whether the shrink does the linear's prologue itself (its GEMV mode's rows)."""
    from compiled.linear.lora_kernels import GEMV_MAX_T
    return x.shape[0] <= GEMV_MAX_T and _in_kernel(x, weight, slices, fp8)


def _args(s: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slot: torch.Tensor, slices: list[int]):
    from compiled.linear.lora_kernels import LoRAArgs
    return LoRAArgs.of(s, b, scale, slot, list(slices))


LORA_OPERANDS = ("lora_a", "lora_b", "lora_scale", "lora_slot", "lora_slices")


def lora_operands(op: str, a: torch.Tensor | None, b: torch.Tensor | None, scale: torch.Tensor | None,
                  slot: torch.Tensor | None, slices: list[int] | None) -> tuple | None:
    """An op's optional LoRA operands as (a, b, scale, slot, slices), or None where none is given:
    all or none (the slots alone may serve another operand's LoRA), else a one-line error."""
    if a is None and b is None and scale is None and slices is None:
        return None
    given = (a, b, scale, slot, slices)
    missing = [name for name, value in zip(LORA_OPERANDS, given) if value is None]
    if missing:
        raise ValueError(f"{op}: LoRA needs all of {', '.join(LORA_OPERANDS)}; missing {', '.join(missing)}")
    return given


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


def linear_lora(x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                slot: torch.Tensor, slices: list[int], fp8: WeightScale | None = None) -> torch.Tensor:
    """`x @ weight.T` plus each row's LoRA delta (`lora_shrink` by a, `lora_expand` by b), rounded
    as the two ops round. `fp8`: the weight is FP8 with this scale (`fp8.py`)."""
    check_lora("compiled::linear", x, stand_in(weight, fp8, x.dtype), a, b, scale, slot, slices)
    if _in_kernel(x, weight, slices, fp8):
        from compiled.linear.skinny_kernels import skinny_linear_lora_triton
        return skinny_linear_lora_triton(x, weight, _args(shrink(x, a, slot), b, scale, slot, slices), fp8=fp8)
    y, s = _linear_beside_shrink(x, weight, a, slot, fp8)
    return expand(y, s, b, scale, slot, slices)


def linear_then_expand(x: torch.Tensor, weight: torch.Tensor, s: torch.Tensor, b: torch.Tensor,
                       scale: torch.Tensor, slot: torch.Tensor, slices: list[int],
                       fp8: WeightScale | None = None, quantized: QuantizedRows | None = None) -> torch.Tensor:
    """The linear of x plus the deltas of shrink outputs s made elsewhere: the skinny GEMM's
    epilogue adds them where it serves the linear, so does an FP8 linear's W8A16 / W8A8 kernel of
    one K split (`fp8.lora_in_epilogue`), the expand's launch otherwise; `fp8` as
    `linear_lora`'s; `quantized`: x already quantized into `linear.fp8.input_buffers(x, weight, fp8)`."""
    if _in_kernel(x, weight, slices, fp8):
        from compiled.linear.skinny_kernels import skinny_linear_lora_triton
        return skinny_linear_lora_triton(x, weight, _args(s, b, scale, slot, slices), fp8=fp8)
    if _kernels_take(x, slices) and fp8_linear.lora_in_epilogue(x, weight, fp8, quantized is not None):
        return fp8_linear.linear(x, weight, fp8, quantized, lora=_args(s, b, scale, slot, slices))
    return expand(fp8_linear.linear(x, weight, fp8, quantized), s, b, scale, slot, slices)


def _linear_beside_shrink(x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, slot: torch.Tensor,
                          fp8: WeightScale | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the base linear, the shrink): the shrink, a few SMs' work, on the side stream beside the GEMM."""
    fork = Fork(x.device)
    with fork.side():
        s = shrink(x, a, slot)
    y = fp8_linear.linear(x, weight, fp8)
    fork.join()
    return y, s


def add_rms_norm_linear_lora(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             weight: torch.Tensor, keep_normed: bool, a: torch.Tensor, b: torch.Tensor,
                             scale: torch.Tensor, slot: torch.Tensor, slices: list[int],
                             fp8: WeightScale | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm_linear` whose y has the LoRA deltas of its input, normed; `fp8` as `linear_lora`'s."""
    check_norm_lora(x, delta, norm_weight, stand_in(weight, fp8, x.dtype), a, b, scale, slot, slices)
    if delta.stride(-1) == 1 and _prologue_in_shrink(x, weight, slices, fp8):
        from compiled.linear.lora_kernels import shrink_after_norm_triton
        from compiled.linear.skinny_kernels import add_rms_norm_linear_triton
        s = shrink_after_norm_triton(x, delta, norm_weight, eps, a, slot)
        y, h, normed = add_rms_norm_linear_triton(x, delta, norm_weight, eps, weight, keep_normed,
                                                  lora=_args(s, b, scale, slot, slices), fp8=fp8)
    else:
        if fp8 is None:
            y, h, normed = fused.add_rms_norm_linear(x, delta, norm_weight, eps, weight, True)
        else:
            h, normed = fused.add_rms_norm(x, delta, norm_weight, eps)
            y = fp8_linear.linear(normed, weight, fp8)
        y = expand(y, shrink(normed, a, slot), b, scale, slot, slices)
    return y, h, normed if keep_normed else x.new_empty(0)


def check_norm_lora(x, delta, norm_weight, weight, a, b, scale, slot, slices) -> None:
    op = "compiled::add_rms_norm_linear"
    fused.check_norm(x, delta, norm_weight, weight, op)
    check_lora(op, x, weight, a, b, scale, slot, slices)


def silu_mul_linear_lora(gate_up: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         scale: torch.Tensor, slot: torch.Tensor, slices: list[int],
                         fp8: WeightScale | None = None) -> torch.Tensor:
    """`silu_mul_linear` plus the LoRA deltas of its input, silu(gate) * up; `fp8` as `linear_lora`'s."""
    check_silu_lora(gate_up, stand_in(weight, fp8, gate_up.dtype), a, b, scale, slot, slices)
    if _prologue_in_shrink(gate_up[:, :weight.shape[1]], weight, slices, fp8):
        from compiled.linear.lora_kernels import shrink_after_silu_triton
        from compiled.linear.skinny_kernels import silu_mul_linear_triton
        s = shrink_after_silu_triton(gate_up, a, slot)
        return silu_mul_linear_triton(gate_up, weight, lora=_args(s, b, scale, slot, slices), fp8=fp8)
    return linear_lora(fused.silu_and_mul(gate_up), weight, a, b, scale, slot, slices, fp8)


def check_silu_lora(gate_up, weight, a, b, scale, slot, slices) -> None:
    fused.check_silu(gate_up, weight, "compiled::silu_mul_linear")
    check_lora("compiled::silu_mul_linear", gate_up[:, :weight.shape[1]], weight, a, b, scale, slot, slices)


def linear_lora_add_rms_norm_linear(x: torch.Tensor, inp: torch.Tensor, w_in: torch.Tensor, a: torch.Tensor,
                                    b: torch.Tensor, scale: torch.Tensor, slot: torch.Tensor,
                                    norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, keep_normed: bool,
                                    w_in_fp8: WeightScale | None = None, fp8: WeightScale | None = None
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm_linear(x, linear_lora(inp, w_in, a, b, scale, slot, [N]), norm_weight, eps,
    weight, keep_normed)`: a LoRA'd linear of one slice whose output is the residual add's delta
    (o_proj before the post-attention norm and the router). Where cuBLAS runs both linears and the
    norm is a launch of its own, that launch adds the deltas (`prologue_kernels`, LORA): the
    expand's own launch goes. Elsewhere the two run in turn. `w_in_fp8`, `fp8`: either weight FP8
    (`fp8.py`)."""
    check_delta_lora(x, inp, stand_in(w_in, w_in_fp8, x.dtype), a, b, scale, slot, norm_weight,
                     stand_in(weight, fp8, x.dtype))
    if _expand_in_norm(x, inp, w_in, weight, w_in_fp8 is not None, fp8 is not None):
        from compiled.linear.prologue_kernels import add_rms_norm_triton
        y_in, s = _linear_beside_shrink(inp, w_in, a, slot, w_in_fp8)
        h, normed = add_rms_norm_triton(x, y_in, norm_weight, eps, lora=_args(s, b, scale, slot, [w_in.shape[0]]))
        y = fp8_linear.linear(normed, weight, fp8)
    else:
        delta = linear_lora(inp, w_in, a, b, scale, slot, [w_in.shape[0]], w_in_fp8)
        y, h, normed = fp8_linear.add_rms_norm_linear(x, delta, norm_weight, eps, weight, keep_normed, fp8)
    return y, h, normed if keep_normed else x.new_empty(0)


def _expand_in_norm(x: torch.Tensor, inp: torch.Tensor, w_in: torch.Tensor, weight: torch.Tensor,
                    w_in_fp8: bool = False, fp8: bool = False) -> bool:
    """Whether the norm's launch adds the deltas: decode sizes, the LoRA and norm kernels allowed,
    neither linear the skinny GEMM's (it has the expand, or the norm, in its own launch). Past
    SKINNY_MAX_M rows the deltas stay in the norm's launch even where the skinny GEMM takes the
    weight after it (the router, `max_rows`): that GEMM then runs without its norm prologue, and the
    expand needs no launch of its own (8 adapters at 17-64 rows, bench/RESULTS.md)."""
    past_skinny = x.shape[0] > SKINNY_MAX_M
    return (inp.shape[0] <= NORM_LORA_MAX_T and lora.use_kernel(inp) and fused.own_launch(x)
            and not ops.use_kernel(inp, w_in, w_in_fp8) and (past_skinny or not ops.use_kernel(x, weight, fp8)))


def check_delta_lora(x, inp, w_in, a, b, scale, slot, norm_weight, weight) -> None:
    """The checks of `add_rms_norm_linear` whose delta is `inp`'s LoRA'd linear by w_in."""
    op = "compiled::add_rms_norm_linear"
    check_lora(op, inp, w_in, a, b, scale, slot, [w_in.shape[0]])
    fused.check_norm(x, x.new_empty(()).expand(inp.shape[0], w_in.shape[0]), norm_weight, weight, op,
                     delta_name="delta_weight's output")
