"""Which adapter slot each token of the current forward uses: the runner installs it as the forward
context's `lora_slots` (`compiled/forward_context.py`), the graph reads it once through
`compiled::lora_token_slots` and hands it to every LoRA op.

Like the attention context, the slots are a view of the runner's static buffers, so a captured
CUDA graph replays over fresh values; the op copies them into an activation of the graph (one
small launch per forward), which keeps every LoRA op a plain function of its inputs."""

from __future__ import annotations

import torch

from compiled.forward_context import current_forward


@torch.library.custom_op("compiled::lora_token_slots", mutates_args=())
def lora_token_slots(input_ids: torch.Tensor) -> torch.Tensor:
    """The installed slots of this forward's `len(input_ids)` tokens, as `[T]` int32."""
    slots = current_forward().lora_slots
    if slots is None:
        raise RuntimeError("compiled::lora_token_slots ran outside forward_context(lora_slots=...): "
                           "the runner installs them")
    return slots[:input_ids.shape[0]].to(torch.int32, copy=True)


@lora_token_slots.register_fake
def _(input_ids):
    return input_ids.new_empty(input_ids.shape, dtype=torch.int32)
