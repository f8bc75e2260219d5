"""The split-K workspaces of the linear kernels (skinny GEMM and W8A16 GEMM sharing one, LoRA
shrink): one per kernel and device, allocated at its largest size on first use and never again.

A split-K launch writes fp32 partials to its workspace and counts finished splits on its
semaphores (the last split resets them to 0), so a captured CUDA graph replays over the same
addresses. The one rule inside a capture: a kernel whose workspace was not allocated before the
capture raises `WorkspaceError`, naming the kernel. An allocation inside a capture would come from
the graph's private pool and be reused by later graphs, so it cannot be kept; and silently running
unsplit instead would make a captured graph slower than the eager step it stands for. The
runtime's warm-up runs every shape once before capturing it, so the workspace is always there
first. Launches that share a workspace on one device must be stream-ordered (the semaphores)."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from compiled.errors import CompiledError

W = TypeVar("W")

_ALLOCATED: dict[tuple[str, torch.device], object] = {}


class WorkspaceError(CompiledError, RuntimeError):
    """A kernel's split-K workspace was first needed inside a CUDA graph capture."""


def is_capturing(device: torch.device) -> bool:
    """Whether this thread's current stream on `device` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def split_workspace(kernel: str, device: torch.device, allocate: Callable[[torch.device], W]) -> W:
    """`kernel`'s workspace on `device`: `allocate(device)` on first use (outside a capture)."""
    key = (kernel, device)
    ws = _ALLOCATED.get(key)
    if ws is None:
        if is_capturing(device):
            raise WorkspaceError(f"{kernel}: split-K workspace first needed inside a CUDA graph capture on "
                                 f"{device}; run the kernel once at this shape before capturing")
        ws = _ALLOCATED[key] = allocate(device)
    return ws


def allocated(kernel: str, device: torch.device) -> object | None:
    """`kernel`'s workspace on `device` if it was allocated (tests check its semaphores)."""
    return _ALLOCATED.get((kernel, device))
