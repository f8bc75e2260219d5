"""The per-step attention context that the attention custom op reads: the metadata of the batch
and the KV pools, which the runner installs as the forward context's `attention` for the duration
of a forward (`compiled/forward_context.py`); every attention layer finds them by index. All
tensors are views of the runner's static buffers, so a captured graph can replay over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from compiled.attention.kv_cache import KVPool


@dataclass
class AttentionMetadata:
    out_cache_loc: torch.Tensor     # [T] pool slot receiving each new token's K/V
    req_pool_indices: torch.Tensor  # [B] row of req_to_token per request
    seq_lens: torch.Tensor          # [B] tokens in cache after this step (prefix + new)
    extend_lens: torch.Tensor       # [B] new tokens per request (1 in decode)
    # Host copies so the torch reference never synchronises with the device.
    req_pool_indices_cpu: list[int]
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    is_decode: bool
    # [B] offset of each request's first new token in the packed batch (exclusive cumsum of
    # extend_lens); the Triton extend kernel reads it. None: computed on the device when needed.
    extend_start_loc: torch.Tensor | None = None
    # In a step that is not all decode: the first `decode_rows` requests have one new token each
    # (the scheduler puts them first), and the decode kernel attends for them: the extend
    # kernel's 64-128-row query tiles would hold one live row each over their whole context.
    decode_rows: int = 0

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    # The longest new part and cached prefix among the requests the extend kernel runs: those
    # after the `decode_rows`.
    @property
    def max_extend_len(self) -> int:
        return max(self.extend_lens_cpu[self.decode_rows:], default=0)

    @property
    def max_prefix_len(self) -> int:
        n = self.decode_rows
        return max((s - e for s, e in zip(self.seq_lens_cpu[n:], self.extend_lens_cpu[n:])), default=0)


@dataclass
class AttentionContext:
    meta: AttentionMetadata
    kv: KVPool
    req_to_token: torch.Tensor
    # Given q, the buffer attention writes its output into (piecewise CUDA graphs read it in
    # place); None: a fresh tensor.
    attention_out: Callable[[torch.Tensor], torch.Tensor] | None = None

