"""The per-step attention context that the attention custom op reads: the metadata of the batch
and the KV pools, which the runner installs as the forward context's `attention` for the duration
of a forward (`compiled/forward_context.py`); every attention layer finds them by index. All
tensors are views of the runner's static buffers, so a captured graph can replay over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from compiled.attention.kv_cache import KVPool


# A chunk of a mixed step attends as rows of the decode kernel (`AttentionMetadata.token_rows`)
# where that beats the extend kernel, whose one program a query head reads the chunk's prefix
# alone: up to DECODE_ROWS_MAX_CHUNK tokens, each past the first DECODE_ROWS_ANY_PREFIX asking
# DECODE_ROWS_PREFIX_A_TOKEN tokens of prefix (a prompt's tail after a capped step, a short
# prompt, a speculative draft): where the rows measured faster on an H200 with the 30B's heads
# (`bench/mixed_attention_bench.py`, bench/RESULTS.md, extend attention).
DECODE_ROWS_MAX_CHUNK = 32
DECODE_ROWS_ANY_PREFIX = 8
DECODE_ROWS_PREFIX_A_TOKEN = 16


def attends_as_decode_rows(length: int, prefix: int) -> bool:
    """Whether a chunk of `length` new tokens after `prefix` cached ones is one the decode kernel
    attends for in a mixed step (`decode_kernel_share`)."""
    return length <= DECODE_ROWS_MAX_CHUNK and prefix >= DECODE_ROWS_PREFIX_A_TOKEN * (length - DECODE_ROWS_ANY_PREFIX)


def decode_kernel_share(chunks: list[tuple[int, int]], max_rows: int) -> tuple[int, int]:
    """Of a mixed step's chunks ((new tokens, prefix) each, in batch order: the one-token ones
    first, as the scheduler puts them): how many leading ones, and how many tokens of theirs,
    attend through the decode kernel: up to the first for which not `attends_as_decode_rows`,
    while their tokens fit `max_rows` (its workspace's rows)."""
    requests = tokens = 0
    for length, prefix in chunks:
        if not attends_as_decode_rows(length, prefix) or tokens + length > max_rows:
            break
        requests, tokens = requests + 1, tokens + length
    return requests, tokens


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
    # In a step that is not all decode: the first `decode_rows` requests (`decode_kernel_share`)
    # attend through the decode kernel: the extend kernel's 64-128-row query tiles would
    # hold one live row each over their whole context, and for a few new tokens over a long
    # prefix its one program a query head reads the prefix alone. Each has one new token, unless
    # `token_rows` is set: then each of their tokens is a row of the decode kernel, its request's
    # table row `token_rows[t]` and its context `token_positions[t] + 1` tokens long (`token_lens`:
    # None until the attention op computes it on the device, once a step, as `extend_start_loc`).
    decode_rows: int = 0
    token_rows: torch.Tensor | None = None
    token_positions: torch.Tensor | None = None
    token_lens: torch.Tensor | None = None

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

