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


class _Graph:
    """Stands in for a captured torch.cuda.CUDAGraph (none can be captured without a GPU)."""

    def __init__(self) -> None:
        self.was_reset = False

    def reset(self) -> None:
        self.was_reset = True


def test_release_resets_every_captured_graph_and_forgets_it():
    """A graph that captured an NCCL collective holds the communicator: a tensor-parallel shutdown
    frees the graphs first (`ModelRunner.release_graphs`), through these."""
    from types import SimpleNamespace

    from compiled.compilation.bucket_graphs import BucketGraphs
    from compiled.compilation.piecewise_graphs import PiecewiseGraphs, _Entry

    decode = BucketGraphs([1, 2, 4], pool=None)
    decode.graphs = {1: _Graph(), 4: _Graph()}
    decode.outputs = {1: "out", 4: "out"}
    held = list(decode.graphs.values())
    decode.release()
    assert all(g.was_reset for g in held) and decode.outputs == {} and decode.pending == [1, 2, 4]

    prefill = PiecewiseGraphs([64, 128], pool=None, fixed=[], run_forward=lambda size: None)
    prefill.attach([SimpleNamespace(fn=len, weight_args=[]) for _ in range(3)])
    held = [_Graph() for _ in range(4)]
    for i, graph in enumerate(held):
        prefill.pieces[i % 3].entries[64 if i < 3 else 128] = _Entry(graph, [], ())
    prefill.captured.update({64, 128})
    prefill.release()
    assert all(g.was_reset for g in held)
    assert all(p.entries == {} for p in prefill.pieces) and prefill.captured == set()
