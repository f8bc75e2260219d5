"""The backend switch of the custom ops that have a Triton kernel beside their torch reference, and
the device check for the Hopper-only launch features they use."""

from __future__ import annotations

import functools
import os

import torch

CHOICES = ("auto", "torch", "triton")


class BackendChoice:
    """'auto' (the kernel where it applies, the torch reference elsewhere), 'torch' or 'triton';
    starts from the environment variable `env` (read once, at import of the op's module)."""

    def __init__(self, env: str) -> None:
        self.env = env
        self.name = self.check(os.environ.get(env, "auto") or "auto")

    def check(self, name: str) -> str:
        if name not in CHOICES:
            raise ValueError(f"{self.env}={name!r}: expected one of {', '.join(CHOICES)}")
        return name

    def set(self, name: str) -> None:
        self.name = self.check(name)


def hopper_or_newer(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer (TMA, programmatic dependent launch)."""
    return device.type == "cuda" and _capability(device.index)[0] >= 9


def interpreting() -> bool:
    """Triton kernels run under the CPU interpreter (TRITON_INTERPRET, as Triton itself reads it)."""
    from triton import knobs
    return knobs.runtime.interpret


def tma_descriptor(x: torch.Tensor, block: list[int]):
    """A TMA tensor descriptor over the 2-D `x` with tiles of `block`, or None where TMA cannot
    take it: a 16-bit tensor with unit last stride and 16-byte aligned base and rows, on Hopper
    or newer (or the interpreter). Built per call: a small host object the launcher encodes, and
    caching it would keep freed tensors alive."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    if x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2 or x.stride(1) != 1:
        return None
    if (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        return None
    if not (hopper_or_newer(x.device) or interpreting()):
        return None
    return TensorDescriptor.from_tensor(x, block)


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
