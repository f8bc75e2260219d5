"""Programmatic dependent launch (Hopper+): a decode step's small kernels overlap their launch,
and their weight reads, with the tail of the kernel before them.

A kernel launched with `launch_pdl=True` may start while the previous kernel of the stream is
still running (once all of that kernel's programs have started and called
`gdc_launch_dependents`). Until it calls `gdc_wait`, which returns when the previous kernel has
finished and its writes are visible, it may only read what no kernel writes: the weights. So
each such kernel here starts with `pdl_prologue` (let the next kernel launch too; optionally
prefetch weights into L2), then waits, then does everything else. A kernel that does not take
part (cuBLAS, Inductor's) simply serialises as usual, before and after.

`COMPILED_PDL=0` (read at import) turns it off; it is also off off-GPU, before Hopper and under
the Triton interpreter, where the flag is a compile-time False and the kernels are unchanged."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("COMPILED_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether launches on `device` use programmatic dependent launch."""
    if not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return _hopper_or_newer(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict:
    """`PDL=` (the kernels' constexpr) and Triton's `launch_pdl=` for one launch on `device`."""
    on = use_pdl(device)
    return dict(PDL=on, launch_pdl=True) if on else dict(PDL=False)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (no-ops when PDL is off)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the lines at `ptrs` (one address per 128-byte line is enough); no registers
    are filled, so a program can cover its whole weight range while the previous kernel ends."""
    addr = tl.where(mask, ptrs.to(tl.int64, bitcast=False), 0)   # masked lanes: address 0, skipped
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.u64 p, $1, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)
