"""Bucket sizes: a batch runs in (is padded to) the smallest captured size that holds it."""

from __future__ import annotations


# Decode batches up to this size replay a graph of their own size; larger ones are padded to a
# multiple of the step.
SMALL_DECODE_BATCH, DECODE_BUCKET_STEP = 16, 8


def decode_buckets(max_batch: int) -> list[int]:
    """Every size up to 16, then every 8 up to `max_batch`. Padded rows are not free: in the MoE
    each is a token routed to experts. Ten requests of Qwen3-30B-A3B took 13.51 ms a step in the
    16-row graph, 12.61 in their own (H100, bench/RESULTS.md)."""
    step = DECODE_BUCKET_STEP
    sizes = list(range(1, min(max_batch, SMALL_DECODE_BATCH) + 1)) + list(range(SMALL_DECODE_BATCH + step,
                                                                               max_batch + 1, step))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def eager_buckets(buckets: list[int]) -> list[int]:
    """The decode buckets captured at start: the powers of two and the largest. Each of the others
    is captured when a batch first needs it (that step waits for the capture once) or while a
    server is idle: capturing all 35 buckets of the vLLM-style list (1, 2, 4, every 8) at start
    took 2.8 s of a 6 s start from an artifact (Qwen3-30B-A3B, H200, bench/RESULTS.md)."""
    return [b for b in buckets if b & (b - 1) == 0 or b == buckets[-1]]


def eager_token_buckets(buckets: list[int]) -> list[int]:
    """The piecewise token buckets captured at start: the smallest and the largest (each of the
    others as `eager_buckets` leaves them: 49 graphs a bucket for Qwen3-30B-A3B)."""
    return sorted({buckets[0], buckets[-1]})


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Powers of two from `smallest` up to `max_tokens` (piecewise graphs of prefill batches)."""
    sizes, size = [], smallest
    while size <= max_tokens:
        sizes.append(size)
        size *= 2
    return sizes


def smallest_bucket(buckets: list[int], size: int) -> int | None:
    """The bucket a batch of `size` is padded to: the smallest of the sorted `buckets` >= size."""
    return next((b for b in buckets if b >= size), None)
