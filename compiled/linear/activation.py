"""`compiled::silu_and_mul`: silu(gate) * up over a fused `[..., 2I]` gate/up output.

The silu_and_mul pass swaps this one op in for the separate silu and mul nodes; the torch
reference is the implementation until a kernel replaces it."""

from __future__ import annotations

import torch

from compiled.functional import silu_and_mul_ref


@torch.library.custom_op("compiled::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_ref(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
