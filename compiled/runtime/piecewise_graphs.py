"""CUDA graphs for prefill and mixed batches, one per compiled piece and token bucket (vLLM's
piecewise scheme): attention between the pieces runs eagerly, because its launch depends on the
requests' lengths, and everything else replays.

A graph reads its inputs from, and leaves its outputs in, fixed addresses:
* outputs are copied (inside the graph) into shared slabs, alternating between two sets from one
  piece to the next, so that one forward's worth of activations serves every layer and bucket;
* inputs that arrive elsewhere (attention outputs) are copied into input slabs before replay;
  inputs already at the captured address (the runner's buffers, a previous piece's output slab)
  are used in place.
The temporaries inside each graph come from the pool shared with the decode graphs."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch


@dataclass
class _Mode:
    size: int           # the bucket every activation is padded to
    capturing: bool


_mode: _Mode | None = None


@contextlib.contextmanager
def piecewise_mode(size: int, capturing: bool = False) -> Iterator[None]:
    """While active, graphed pieces replay (or capture) their graph for `size` tokens."""
    global _mode
    previous, _mode = _mode, _Mode(size, capturing)
    try:
        yield
    finally:
        _mode = previous


class Slabs:
    """Activation buffers at the largest bucket, handed out as views of the first `size` rows."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.buffers: dict[tuple, torch.Tensor] = {}

    def view(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        full_key = (key, tuple(like.shape[1:]), like.dtype)
        buf = self.buffers.get(full_key)
        if buf is None:
            # Zeroed: during capture, pieces that are not warmed up leave their slabs unwritten,
            # and the eager attention after them reads these values.
            buf = self.buffers[full_key] = torch.zeros((self.max_tokens, *like.shape[1:]), dtype=like.dtype,
                                                       device=like.device)
        return buf[:like.shape[0]]


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor | None]   # the captured activation inputs (None: a weight)
    outputs: tuple[torch.Tensor, ...]


class PieceGraphs:
    """The graphs of one piece (one layer's instance: its weights are fixed inputs)."""

    def __init__(self, fn: Callable, weight_args: list[bool], index: int, owner: "PiecewiseGraphs") -> None:
        self.fn, self.weight_args, self.index, self.owner = fn, weight_args, index, owner
        self.entries: dict[int, _Entry] = {}

    def __call__(self, args: tuple, mode: _Mode) -> tuple[torch.Tensor, ...]:
        if mode.capturing:
            return self._capture(mode.size, args)
        entry = self.entries[mode.size]
        for arg, static in zip(args, entry.inputs):
            if static is not None and arg.data_ptr() != static.data_ptr():
                static.copy_(arg)
        entry.graph.replay()
        return entry.outputs

    def _capture(self, size: int, args: tuple):
        owner = self.owner
        inputs: list[torch.Tensor | None] = []
        for i, (arg, is_weight) in enumerate(zip(args, self.weight_args)):
            if is_weight:
                inputs.append(None)
            elif arg.data_ptr() in owner.fixed_ptrs:
                writer = owner.writer.get(arg.data_ptr())
                if writer is not None and writer != self.index - 1:
                    # The slab set alternates per piece: only the previous piece's outputs survive.
                    raise RuntimeError(f"piecewise CUDA graphs: piece {self.index} reads an output of piece {writer}")
                inputs.append(arg)
            else:
                slab = owner.slabs.view(("in", i), arg)
                slab.copy_(arg)
                inputs.append(slab)
        call_args = [a if s is None else s for a, s in zip(args, inputs)]
        if (self.fn, size) not in owner.warmed:
            # Lazy kernel compilation and autotuning must not happen inside a capture; they are
            # per compiled function and size, so one instance of identical layers warms up.
            owner.warmed.add((self.fn, size))
            self.fn(*call_args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=owner.pool):
            out = self.fn(*call_args)
            outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
            slabs = tuple(owner.slabs.view(("out", self.index % 2, j), o) for j, o in enumerate(outs))
            for slab, o in zip(slabs, outs):
                slab.copy_(o)
        for slab in slabs:
            owner.fixed_ptrs.add(slab.data_ptr())
            owner.writer[slab.data_ptr()] = self.index
        self.entries[size] = _Entry(graph, inputs, slabs)
        return slabs


class PiecewiseGraphs:
    """All pieces' graphs for a list of token buckets."""

    def __init__(self, buckets: list[int], pool, fixed: list[torch.Tensor]) -> None:
        self.buckets = sorted(buckets)
        self.pool = pool
        self.slabs = Slabs(self.buckets[-1])
        # Addresses that stay put between steps: graph inputs found there are used in place.
        self.fixed_ptrs: set[int] = {t.data_ptr() for t in fixed}
        self.writer: dict[int, int] = {}  # output slab address -> index of the piece writing it
        self.warmed: set[tuple[Callable, int]] = set()  # (compiled function, size) already run once
        self.capture_seconds = 0.0
        self.replays = 0  # forwards that replayed these graphs (tests check they are used)

    def attach(self, pieces: list) -> None:
        """Give each compiled piece (in forward order) its graphs."""
        for index, piece in enumerate(pieces):
            piece.graphs = PieceGraphs(piece.fn, piece.weight_args, index, self)

    def capture(self, run_forward: Callable[[int], None]) -> None:
        """`run_forward(size)` stages a padding-only batch of `size` tokens and runs the model;
        buckets go largest first so smaller ones reuse the pool's blocks."""
        start = time.perf_counter()
        for size in reversed(self.buckets):
            with piecewise_mode(size, capturing=True):
                run_forward(size)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start


def current_mode() -> _Mode | None:
    return _mode
