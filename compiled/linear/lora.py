"""Multi-LoRA deltas of a linear: `compiled::lora_shrink` and `compiled::lora_expand`.

One batch serves many adapters. The adapters' weights sit in a slot pool of S slots, ranks
zero-padded to the pool's R (a zero-padded rank adds zeros, so no per-slot rank is needed), and
each token names its slot (`slot [T]` int32, -1: no adapter). A linear `y = x @ W.T` whose
output is N slices (q, k, v -> 3; gate, up -> 2; o, down -> 1) gets its delta in two ops:

    s = compiled::lora_shrink(x, a, slot)                      # a [S, N*R, in] -> s [T, N*R] fp32
    y = compiled::lora_expand(y, s, b, scale, slot, slices)    # b [S, out, R], scale [S, N] fp32

`lora_shrink`: s[t] = a[slot[t]] @ x[t] in fp32; zeros where slot[t] is -1 (or outside [0, S)).
`lora_expand`: a new tensor (y's dtype): for each slice i, with columns rows_i of y (`slices` are
the slices' widths, summing to out), y[t, rows_i] + scale[slot[t], i] * s[t, i*R:(i+1)*R] @
b[slot[t], rows_i, :].T, the sum in fp32 and rounded once; rows without an adapter are y's.

A linear and both ops are one op, `compiled::linear` with its LoRA operands (`library.py`,
`lora_linear.py`; the fuse_lora_linear pass routes the graph's triples there): at decode sizes
the expand runs in the linear's epilogue.

All are opaque custom ops with fake implementations, so they trace into torch.fx and compile
under Inductor. Backends (`BACKEND`: the engine config's `lora_backend`, where
`COMPILED_LORA_BACKEND` wins, or `set_backend()`): 'auto'
(the Triton kernels of `lora_kernels` on CUDA, the torch references elsewhere), 'torch', 'triton'
(anywhere; on CPU under `TRITON_INTERPRET=1`). The references are the CPU path and the oracle:
one masked dense product per slot, no host sync."""

from __future__ import annotations

import torch

from compiled.backend import BackendChoice
from compiled.linear import LORA_MAX_SLICES

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

BACKEND = BackendChoice("COMPILED_LORA_BACKEND")


def set_backend(name: str) -> None:
    """'auto' (Triton on CUDA, torch elsewhere), 'torch' or 'triton'."""
    BACKEND.set(name)


def use_kernel(x: torch.Tensor) -> bool:
    if BACKEND.name == "auto":
        return x.is_cuda
    return BACKEND.name == "triton"


# ----------------------------------------------------------------------------- references

def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """x `[T, in]`, a `[S, N*R, in]`, slot `[T]` -> `[T, N*R]` fp32."""
    xf = x.float()
    out = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for s in range(a.shape[0]):
        out = torch.where((slot == s)[:, None], xf @ a[s].float().T, out)
    return out


def lora_expand_ref(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slot: torch.Tensor,
                    slices: list[int]) -> torch.Tensor:
    """y `[T, out]`, s `[T, N*R]` fp32, b `[S, out, R]`, scale `[S, N]` -> y + delta in y's dtype."""
    R = b.shape[2]
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    for slot_id in range(b.shape[0]):
        parts, lo = [], 0
        for i, width in enumerate(slices):
            si = s[:, i * R:(i + 1) * R].float() * scale[slot_id, i].float()
            parts.append(si @ b[slot_id, lo:lo + width].float().T)
            lo += width
        delta = torch.where((slot == slot_id)[:, None], torch.cat(parts, dim=1), delta)
    return (y.float() + delta).to(y.dtype)


# ----------------------------------------------------------------------------- shape checks

def _check_slot(op: str, slot: torch.Tensor, T: int) -> None:
    if slot.dim() != 1 or slot.shape[0] != T or slot.dtype != torch.int32:
        raise ValueError(f"{op}: slot {tuple(slot.shape)} {slot.dtype}, expected ({T},) torch.int32")


def _check_devices(op: str, **tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError(f"{op}: tensors on several devices: "
                         + ", ".join(f"{n} on {t.device}" for n, t in tensors.items()))


def check_shrink(x: torch.Tensor, a: torch.Tensor, slot: torch.Tensor) -> None:
    op = "compiled::lora_shrink"
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"{op}: x {tuple(x.shape)}, a {tuple(a.shape)}: expected x [T, in] and a [S, N*R, in]")
    if x.dtype not in FLOAT_DTYPES or a.dtype != x.dtype:
        raise ValueError(f"{op}: x is {x.dtype}, a is {a.dtype}: expected one of bfloat16, float16, float32")
    _check_slot(op, slot, x.shape[0])
    _check_devices(op, x=x, a=a, slot=slot)


def check_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slot: torch.Tensor,
                 slices: list[int]) -> None:
    op = "compiled::lora_expand"
    if y.dim() != 2 or b.dim() != 3 or b.shape[1] != y.shape[1]:
        raise ValueError(f"{op}: y {tuple(y.shape)}, b {tuple(b.shape)}: expected y [T, out] and b [S, out, R]")
    if not slices or any(w <= 0 for w in slices) or sum(slices) != y.shape[1]:
        raise ValueError(f"{op}: slices {list(slices)} must be positive widths summing to y's {y.shape[1]} columns")
    S, _, R = b.shape
    N = len(slices)
    if s.shape != (y.shape[0], N * R) or s.dtype != torch.float32:
        raise ValueError(f"{op}: s {tuple(s.shape)} {s.dtype}, expected ({y.shape[0]}, {N * R}) torch.float32 "
                         f"({N} slices of rank {R})")
    if scale.shape != (S, N) or scale.dtype != torch.float32:
        raise ValueError(f"{op}: scale {tuple(scale.shape)} {scale.dtype}, expected ({S}, {N}) torch.float32")
    if y.dtype not in FLOAT_DTYPES or b.dtype != y.dtype:
        raise ValueError(f"{op}: y is {y.dtype}, b is {b.dtype}: expected one of bfloat16, float16, float32")
    _check_slot(op, slot, y.shape[0])
    _check_devices(op, y=y, s=s, b=b, scale=scale, slot=slot)


# ----------------------------------------------------------------------------- the ops

@torch.library.custom_op("compiled::lora_shrink", mutates_args=())
def lora_shrink(x: torch.Tensor, a: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """x `[T, in]`, a `[S, N*R, in]`, slot `[T]` int32 -> s `[T, N*R]` fp32 (zeros where slot is -1)."""
    return shrink(x, a, slot)


def shrink(x: torch.Tensor, a: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """`lora_shrink`'s body: the kernel where `use_kernel` says so, the reference otherwise."""
    check_shrink(x, a, slot)
    if use_kernel(x):
        from compiled.linear.lora_kernels import lora_shrink_triton
        return lora_shrink_triton(x, a, slot)
    return lora_shrink_ref(x, a, slot)


@lora_shrink.register_fake
def _(x, a, slot):
    check_shrink(x, a, slot)
    return x.new_empty((x.shape[0], a.shape[1]), dtype=torch.float32)


@torch.library.custom_op("compiled::lora_expand", mutates_args=())
def lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slot: torch.Tensor,
                slices: list[int]) -> torch.Tensor:
    """y `[T, out]` + each row's delta: slice i of the columns gets scale[slot, i] * s[:, i*R:(i+1)*R]
    @ b[slot, rows_i, :].T. Returns a new tensor in y's dtype; rows with slot -1 are y's."""
    return expand(y, s, b, scale, slot, slices)


def expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slot: torch.Tensor,
           slices: list[int]) -> torch.Tensor:
    """`lora_expand`'s body: the kernel where `use_kernel` says so (and at most LORA_MAX_SLICES
    slices), the reference otherwise."""
    check_expand(y, s, b, scale, slot, slices)
    if use_kernel(y) and len(slices) <= LORA_MAX_SLICES:
        from compiled.linear.lora_kernels import lora_expand_triton
        return lora_expand_triton(y, s, b, scale, slot, list(slices))
    return lora_expand_ref(y, s, b, scale, slot, list(slices))


@lora_expand.register_fake
def _(y, s, b, scale, slot, slices):
    check_expand(y, s, b, scale, slot, slices)
    return torch.empty_like(y, memory_format=torch.contiguous_format)
