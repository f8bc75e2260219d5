"""Bucket lists: the decode buckets, which of them are captured at start, the token buckets."""

from __future__ import annotations

import pytest

from compiled.compilation.buckets import (decode_buckets, eager_buckets, eager_token_buckets, smallest_bucket,
                                         token_buckets)


def test_decode_buckets_are_every_small_size_then_every_8():
    assert decode_buckets(4) == [1, 2, 3, 4]
    assert decode_buckets(20) == list(range(1, 17)) + [20]
    assert decode_buckets(256)[-3:] == [240, 248, 256] and len(decode_buckets(256)) == 46


@pytest.mark.parametrize("buckets, eager", [
    (decode_buckets(256), [1, 2, 4, 8, 16, 32, 64, 128, 256]),
    (decode_buckets(20), [1, 2, 4, 8, 16, 20]),
    (decode_buckets(12), [1, 2, 4, 8, 12]),
    ([3, 5, 6], [6]),          # no power of two: the largest alone
    ([1, 2, 3, 12, 24, 32], [1, 2, 32]),
])
def test_eager_buckets_are_the_powers_of_two_and_the_largest(buckets, eager):
    assert eager_buckets(buckets) == eager


def test_token_buckets_and_smallest_bucket():
    assert token_buckets(100) == [16, 32, 64]
    assert smallest_bucket([1, 2, 4, 8], 5) == 8 and smallest_bucket([1, 2, 4, 8], 9) is None


def test_eager_token_buckets_are_the_smallest_and_the_largest():
    assert eager_token_buckets(token_buckets(2048)) == [16, 2048]
    assert eager_token_buckets([16]) == [16]
