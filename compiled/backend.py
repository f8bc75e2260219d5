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


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
