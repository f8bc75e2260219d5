"""The zigzag plan of a context-parallel step: every token computed once, balanced, and gathered
back into batch order."""

from __future__ import annotations

import random

import pytest

from compiled.parallel.zigzag import ChunkShape, plan, split_lengths


def _shapes(lengths: list[int], split: list[bool]) -> list[ChunkShape]:
    shapes, offset = [], 0
    for n, s in zip(lengths, split):
        shapes.append(ChunkShape(offset, 7 * len(shapes), n, s))   # a cached prefix of 7 per chunk index
        offset += n
    return shapes


def test_worked_examples():
    # 16 tokens on 2 ranks: rank 0 takes segments 0 and 3, rank 1 segments 1 and 2
    p = plan(_shapes([16], [True]), 2)
    assert p.local_index(0).tolist() == [*range(0, 4), *range(12, 16)]
    assert p.local_index(1).tolist() == [*range(4, 12)]
    # 11 tokens on 2 ranks: segments 3, 3, 3, 2; rank 0 holds 5 tokens and pads one row
    assert split_lengths(11, 2) == [3, 3, 3, 2]
    p = plan(_shapes([11], [True]), 2)
    assert p.local_counts == [5, 6] and p.max_local == 6
    assert [(s.position, s.length) for s in p.segments[0]] == [(0, 3), (9, 2)]
    # 10 tokens on 4 ranks
    p = plan(_shapes([10], [True]), 4)
    assert [p.local_index(r).tolist() for r in range(4)] == [[0, 1, 9], [2, 3, 8], [4, 7], [5, 6]]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_token_once_balanced_and_gathered_in_order(world):
    rng = random.Random(world)
    for _ in range(200):
        n = rng.randint(1, 4)
        split = [rng.random() < 0.6 for _ in range(n)]
        lengths = [rng.randint(2 * world, 40) if s else rng.randint(1, 9) for s in split]
        shapes = _shapes(lengths, split)
        p = plan(shapes, world)
        total = sum(lengths)
        assert sorted(i for r in range(world) for i in p.local_index(r).tolist()) == list(range(total))
        # gathering every rank's rows (padded to max_local) and picking gather_index restores batch order
        gathered = []
        for r in range(world):
            rows = p.local_index(r).tolist()
            gathered += rows + [-1] * (p.max_local - len(rows))
        assert [gathered[i] for i in p.gather_index.tolist()] == list(range(total))
        for r in range(world):
            for s in p.segments[r]:
                c = shapes[s.chunk]
                assert s.position - c.position == s.offset - c.offset   # a segment's positions follow its rows
        # a split chunk gives every rank two segments of at most ceil(T / 2N) tokens
        for c, (i, shape) in zip(lengths, enumerate(shapes)):
            if shape.split:
                per_rank = [sum(s.length for s in p.segments[r] if s.chunk == i) for r in range(world)]
                assert max(per_rank) - min(per_rank) <= 1
                assert sum(per_rank) == c


def test_a_chunk_too_short_to_split_is_refused():
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        plan(_shapes([5], [True]), 3)
