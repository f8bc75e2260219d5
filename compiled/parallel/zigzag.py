"""Which tokens each rank computes in a context-parallel step, and how the ranks' rows go back to
the batch's order.

A split chunk of T tokens (T >= 2N for N ranks) is cut into 2N segments, the first T % 2N one token
longer; rank r takes segments r and 2N-1-r, so every rank gets one early segment (little causal
work) and one late segment (much), and the work balances. Chunks that are not split (short
prompts, decode tokens) run whole on rank 0. Each rank's tokens are its segments in batch order;
every segment attends as a request of its own whose cached prefix is everything before it.

Gathering: each rank's rows padded to the longest rank's count, all-gathered rank after rank, and
`gather_index[i]` is the row of the batch's token i in that buffer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ChunkShape:
    """A chunk of the step as the plan sees it: its first token's offset in the batch, its
    first position in the request, its length, and whether it is split over the ranks."""
    offset: int
    position: int
    length: int
    split: bool


@dataclass(frozen=True)
class Segment:
    """Tokens [offset, offset + length) of the batch (positions from `position`), of chunk `chunk`."""
    chunk: int
    offset: int
    position: int
    length: int


@dataclass(frozen=True)
class CPPlan:
    world: int
    segments: list[list[Segment]]   # per rank, in batch order
    gather_index: np.ndarray        # [T] int64, per batch token: its row in the gathered [world * max_local] buffer

    @property
    def local_counts(self) -> list[int]:
        return [sum(s.length for s in segs) for segs in self.segments]

    @property
    def max_local(self) -> int:
        return max(self.local_counts)

    def local_index(self, rank: int) -> np.ndarray:
        """The batch rows rank `rank` computes, in its local order (int64)."""
        return _rows(self.segments[rank])


def _rows(segments: list[Segment]) -> np.ndarray:
    # Built a segment at a time (numpy), not a token at a time: a long prompt has tens of
    # thousands of tokens and this runs on the step's critical path.
    if not segments:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(s.offset, s.offset + s.length, dtype=np.int64) for s in segments])


def split_lengths(length: int, world: int) -> list[int]:
    """The 2N segment lengths of a split chunk: the first `length % 2N` one token longer."""
    n = 2 * world
    return [length // n + (1 if i < length % n else 0) for i in range(n)]


def plan(chunks: list[ChunkShape], world: int) -> CPPlan:
    segments: list[list[Segment]] = [[] for _ in range(world)]
    for index, c in enumerate(chunks):
        if not c.split:
            segments[0].append(Segment(index, c.offset, c.position, c.length))
            continue
        if c.length < 2 * world:
            raise ValueError(f"a chunk of {c.length} tokens cannot be split over {world} ranks (needs {2 * world})")
        lengths = split_lengths(c.length, world)
        starts = [sum(lengths[:i]) for i in range(2 * world)]
        for r in range(world):
            for s in (r, 2 * world - 1 - r):
                segments[r].append(Segment(index, c.offset + starts[s], c.position + starts[s], lengths[s]))
    for segs in segments:   # batch order within each rank: a chunk's early segment before its late one
        segs.sort(key=lambda s: s.offset)
    total = sum(c.length for c in chunks)
    max_local = max(sum(s.length for s in segs) for segs in segments)
    gather_index = np.zeros(total, dtype=np.int64)
    for rank, segs in enumerate(segments):
        rows = _rows(segs)
        gather_index[rows] = rank * max_local + np.arange(len(rows), dtype=np.int64)
    return CPPlan(world, segments, gather_index)
