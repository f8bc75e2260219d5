"""Bucket sizes: a batch runs in (is padded to) the smallest captured size that holds it."""

from __future__ import annotations


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every 8 up to `max_batch` (as vLLM does)."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


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
