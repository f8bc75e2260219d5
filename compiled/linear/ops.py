"""The body of `compiled::linear` without LoRA: `y = x @ weight.T` (a bias-free nn.Linear), Triton's
skinny GEMM for a few rows (`library.py` registers the op with its optional operands).

The skinny_linear pass routes the model's bias-free linears (and the LM head) through the op.
Decode steps run them at M = 1..16 rows (up to NARROW_MAX_M for a weight of a few rows, the
router: `max_rows`), where the skinny kernel (`skinny_kernels`) streams the weight in one launch;
anything else (more rows, other dtypes, CPU) goes to `F.linear` (cuBLAS).

Backends: 'auto' (the kernel on CUDA for bf16/fp16 up to `max_rows`, torch otherwise),
'torch' (always F.linear), 'triton' (the kernel wherever M and the layout allow it, any device
and fp32 too; forcing it on CPU needs `TRITON_INTERPRET=1`). `BACKEND` holds the choice: the
engine config's (`configure`), where `COMPILED_LINEAR_BACKEND` (read at import) wins, or
`set_backend()`'s."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compiled.backend import BackendChoice
from compiled.linear import max_rows

KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # 'auto' on CUDA; fp32 stays with cuBLAS (TF32 rules)
FORCED_DTYPES = KERNEL_DTYPES + (torch.float32,)


BACKEND = BackendChoice("COMPILED_LINEAR_BACKEND")


def set_backend(name: str) -> None:
    """'auto' (the kernel on CUDA at small M, torch elsewhere), 'torch' or 'triton'."""
    BACKEND.set(name)


def linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def check_shapes(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"compiled::linear: x {tuple(x.shape)} @ weight {tuple(weight.shape)}.T: "
                         f"expected x [..., K] and weight [N, K]")
    if x.dtype != weight.dtype:
        raise ValueError(f"compiled::linear: x is {x.dtype}, weight is {weight.dtype}")


def use_kernel(x: torch.Tensor, weight: torch.Tensor, fp8: bool = False) -> bool:
    """Whether the skinny kernel serves x `[M, K]` @ weight.T under the current backend. An FP8
    weight (`fp8`) takes it at every size it fits: the other path dequantizes the whole weight."""
    if BACKEND.name == "torch":
        return False
    if BACKEND.name == "auto" and not (x.is_cuda and x.dtype in KERNEL_DTYPES):
        return False
    M, K = x.shape
    N = weight.shape[0]
    fits = (0 < M <= max_rows(N) and K > 0 and N > 0 and x.dtype in FORCED_DTYPES
            and x.stride(1) == 1 and weight.stride(1) == 1 and x.device == weight.device)
    if not fits or BACKEND.name == "triton" or fp8:
        return fits
    from compiled.linear import skinny_kernels as lk
    sms = lk.num_sms(x.device)
    return lk.beats_cublas(lk.skinny_config(M, N, K, sms), N, sms)


def dispatch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x `[..., K]`, weight `[N, K]` -> `[..., N]` (the graph's hidden states are `[T, K]`): the skinny kernel where `use_kernel` allows it, F.linear otherwise.
    `out` (x `[M, K]` only): a contiguous `[M, N]` tensor the result is written to, in its dtype,
    rounded to x's dtype first (the LM head's bf16 logits into the fp32 logits buffer: the kernel
    stores them there, where a copy after F.linear was a launch of its own)."""
    check_shapes(x, weight)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if out is not None:
        if x.dim() != 2 or out.shape != (x.shape[0], weight.shape[0]) or out.stride(1) != 1:
            raise ValueError(f"compiled::linear: out {tuple(out.shape)} for x {tuple(x.shape)} @ weight "
                             f"{tuple(weight.shape)}.T: expected a [M, N] tensor with contiguous rows")
        if not use_kernel(x2, weight):
            return out.copy_(linear_ref(x, weight))
    elif not use_kernel(x2, weight):
        return linear_ref(x, weight)
    from compiled.linear.skinny_kernels import skinny_linear_triton
    y = skinny_linear_triton(x2, weight, out=out)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(nn.Linear):
    """A bias-free nn.Linear computed as compiled::linear: for linears called outside the graph
    (the LM head, applied by the runner to the rows that need logits). Nothing traces it, so it
    calls the op's body directly: the dispatcher's round trip is host time before a prefill's
    first token (H100 host: 149.7 µs a call through the op, 106.2 direct; bench/host_launch_bench.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch(x, self.weight)

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`forward` written into `out` (`[M, N]`, e.g. fp32 logits), rounded as forward rounds."""
        return dispatch(x, self.weight, out=out)

    @classmethod
    def sharing(cls, linear: nn.Linear) -> "SkinnyLinear":
        """A SkinnyLinear holding `linear`'s weight Parameter itself (no copy, ties preserved)."""
        if linear.bias is not None:
            raise ValueError("SkinnyLinear: the linear has a bias")
        # Built on meta so that no second weight is ever allocated, then given the real one.
        module = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        module.weight = linear.weight
        return module
