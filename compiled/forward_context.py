"""What the custom ops read of the forward that runs them, installed once per forward.

The model graph stays free of step plumbing: the runner installs one `ForwardContext` around a
forward (`forward_context`), and the ops find in it the batch's attention metadata and KV pools,
each token's adapter slot, the context-parallel step and the piecewise CUDA-graph mode. Its
tensors are views of the runner's static buffers, so a captured CUDA graph replays over fresh
values at the addresses it captured.

It is a module global, the one the package keeps: the ops are called by Inductor's generated code
and by CUDA-graph replays with nothing but their tensor arguments, so per-step state cannot
travel as an argument without entering every op's schema (and the compiled graphs' inputs)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:   # the fields' types (neither module imports this one)
    from compiled.attention.context import AttentionContext
    from compiled.parallel.context import CPStep


@dataclass(frozen=True)
class PiecewiseMode:
    """While installed, the compiled pieces replay (or capture) their CUDA graph for `size`
    tokens (`compilation/piecewise_graphs.py`)."""
    size: int           # the bucket every activation is padded to
    capturing: bool = False


@dataclass(frozen=True)
class ForwardContext:
    attention: AttentionContext | None = None   # the batch's attention metadata and KV pools
    lora_slots: torch.Tensor | None = None      # `[T_max]` each token's adapter slot (-1: none), LoRA graphs
    cp: CPStep | None = None                    # a context-parallel step; None: the collectives are identities
    piecewise: PiecewiseMode | None = None      # while set, compiled pieces replay (or capture) their graphs


_EMPTY = ForwardContext()
_current = _EMPTY


@contextmanager
def forward_context(attention: AttentionContext | None = None, lora_slots: torch.Tensor | None = None,
                    cp: CPStep | None = None, piecewise: PiecewiseMode | None = None) -> Iterator[ForwardContext]:
    """Install the given fields for the forwards run inside; a field not given (None) keeps the
    enclosing context's value (a piecewise capture sets its mode around the runner's forward)."""
    global _current
    previous = _current
    _current = ForwardContext(previous.attention if attention is None else attention,
                              previous.lora_slots if lora_slots is None else lora_slots,
                              previous.cp if cp is None else cp,
                              previous.piecewise if piecewise is None else piecewise)
    try:
        yield _current
    finally:
        _current = previous


def current_forward() -> ForwardContext:
    """The installed context; outside any forward, one with every field None."""
    return _current
