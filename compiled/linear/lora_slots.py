"""Which adapter slot each token of the current forward uses: the runner installs it, the graph
reads it once through `compiled::lora_token_slots` and hands it to every LoRA op.

Like the attention context, the slots are a view of the runner's static buffers, so a captured
CUDA graph replays over fresh values; the op copies them into an activation of the graph (one
small launch per forward), which keeps every LoRA op a plain function of its inputs."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

_slots: torch.Tensor | None = None


@contextmanager
def token_slots(slots: torch.Tensor) -> Iterator[None]:
    """Install `slots` (`[T_max]` integers, -1: no adapter) for the forwards run inside."""
    global _slots
    previous, _slots = _slots, slots
    try:
        yield
    finally:
        _slots = previous


@torch.library.custom_op("compiled::lora_token_slots", mutates_args=())
def lora_token_slots(input_ids: torch.Tensor) -> torch.Tensor:
    """The installed slots of this forward's `len(input_ids)` tokens, as `[T]` int32."""
    if _slots is None:
        raise RuntimeError("compiled::lora_token_slots ran outside token_slots(): the runner installs them")
    return _slots[:input_ids.shape[0]].to(torch.int32, copy=True)


@lora_token_slots.register_fake
def _(input_ids):
    return input_ids.new_empty(input_ids.shape, dtype=torch.int32)
