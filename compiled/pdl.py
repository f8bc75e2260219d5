"""Programmatic dependent launch (Hopper+): a decode step's small Triton kernels overlap their
launch with the kernel before them.

A kernel launched with `launch_pdl=True` may start while the previous kernel of the stream is
still running, once all of that kernel's programs have started and called
`gdc_launch_dependents`. Each such kernel here begins with `pdl_wait`: it lets the next kernel
launch, then waits (`gdc_wait`) until the previous one has finished and its writes are visible,
and only then writes anything or reads what a kernel of the step may have written: the weights
(the skinny GEMV's first tile) and what the host uploads before the step (decode attention's
lengths and slots) may be read before the wait. A kernel that does not take part (cuBLAS,
Inductor's) serialises as usual, before and after, and so ends any early start. (Prefetching the
next weights into L2 before the wait measured slower, per cache line in the seventh session and
as bulk TMA prefetches in the ninth, and so did prefetching them from the decode attention's grid,
while DRAM idles, in the twelfth; the register loads before the wait measured faster, in the
fifteenth: bench/RESULTS.md.)

`COMPILED_PDL=0` (read at import) turns it off; it is also off off-GPU, before Hopper and under
the Triton interpreter, where the flag is a compile-time False and the kernels are unchanged."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from compiled.backend import hopper_or_newer, interpreting

ENABLED = os.environ.get("COMPILED_PDL", "1") != "0"


def use_pdl(device: torch.device) -> bool:
    """Whether launches on `device` use programmatic dependent launch."""
    return ENABLED and not interpreting() and hopper_or_newer(device)


def launch_kwargs(device: torch.device) -> dict:
    """`PDL=` (the kernels' constexpr) and Triton's `launch_pdl=` for one launch on `device`."""
    on = use_pdl(device)
    return dict(PDL=on, launch_pdl=True) if on else dict(PDL=False)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (no-ops when PDL is off)."""
    pdl_let_next_in(PDL)
    pdl_wait_only(PDL)


@triton.jit
def pdl_wait_only(PDL: tl.constexpr):
    """Wait for the previous kernel, letting the next one in later (`pdl_let_next_in`): for a
    kernel whose grid the early next one would crowd (the skinny GEMM with a prologue)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_let_next_in(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()

