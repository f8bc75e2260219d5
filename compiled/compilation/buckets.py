"""Bucket sizes: a batch runs in (is padded to) the smallest captured size that holds it."""

from __future__ import annotations


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every 8 up to `max_batch` (as vLLM does)."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def eager_buckets(buckets: list[int]) -> list[int]:
    """The decode buckets captured at start: the powers of two and the largest. Each of the others
    is captured when a batch first needs it (that step waits for the capture once) or while a
    server is idle: capturing all 35 default buckets at start took 2.8 s of a 6 s start from an
    artifact (Qwen3-30B-A3B, H200, bench/RESULTS.md)."""
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
