"""CUDA graphs for prefill and mixed batches, one per compiled piece and token bucket (vLLM's
piecewise scheme): attention between the pieces runs eagerly, because its launch depends on the
requests' lengths, and everything else replays.

A graph reads its inputs from, and leaves its outputs in, fixed addresses, with no copies:
* outputs stay where the capture put them, in the pool shared with the decode graphs. The graphs
  keep only unowned views of them, so the pool reuses their memory as soon as the forward is done
  with them, as the allocator does in eager mode; replays run in capture order, so that is safe;
* attention writes its output into one slab the next piece reads in place;
* inputs found elsewhere at capture (none in the model's own forward) are copied into input slabs.
The temporaries inside each graph come from the same pool."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from compiled.compilation.bucket_graphs import capturing
from compiled.forward_context import PiecewiseMode, forward_context


class Slabs:
    """Activation buffers at the largest bucket, handed out as views of the first `size` rows."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.buffers: dict[tuple, torch.Tensor] = {}

    def view(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        full_key = (key, tuple(like.shape[1:]), like.dtype)
        buf = self.buffers.get(full_key)
        if buf is None:
            buf = self.buffers[full_key] = torch.empty((self.max_tokens, *like.shape[1:]), dtype=like.dtype,
                                                       device=like.device)
        return buf[:like.shape[0]]


def unowned_view(t: torch.Tensor) -> torch.Tensor:
    """A view of `t`'s memory that does not keep it allocated (Inductor's CUDA-graph trees hold
    their outputs the same way)."""
    storage = t.untyped_storage()
    unowned = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(unowned, t.storage_offset(), t.shape, t.stride())


@dataclass
class _Input:
    address: int                 # where the graph reads this activation
    slab: torch.Tensor | None    # the input slab it is copied into first; None: read in place


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    inputs: list[_Input | None]   # per positional input; None: a weight
    outputs: tuple[torch.Tensor, ...]  # unowned views of what the capture returned


class PieceGraphs:
    """The graphs of one piece (one layer's instance: its weights are fixed inputs)."""

    def __init__(self, fn: Callable, weight_args: list[bool], index: int, owner: "PiecewiseGraphs") -> None:
        self.fn, self.weight_args, self.index, self.owner = fn, weight_args, index, owner
        self.entries: dict[int, _Entry] = {}

    def release(self) -> None:
        """Free this piece's captured graphs."""
        for entry in self.entries.values():
            entry.graph.reset()
        self.entries.clear()

    def __call__(self, args: tuple, mode: PiecewiseMode) -> tuple[torch.Tensor, ...]:
        if mode.capturing:
            return self._capture(mode.size, args)
        entry = self.entries[mode.size]
        for arg, static in zip(args, entry.inputs):
            if static is None:
                continue
            if static.slab is not None:
                static.slab.copy_(arg)
            elif arg.data_ptr() != static.address:
                raise RuntimeError(f"piecewise CUDA graphs: piece {self.index} input moved since capture "
                                   f"({arg.data_ptr():#x}, captured at {static.address:#x})")
        entry.graph.replay()
        return entry.outputs

    def _capture(self, size: int, args: tuple):
        owner = self.owner
        inputs: list[_Input | None] = []
        call_args = []
        for i, (arg, is_weight) in enumerate(zip(args, self.weight_args)):
            if is_weight:
                inputs.append(None)
            elif arg.data_ptr() in owner.fixed_ptrs:
                inputs.append(_Input(arg.data_ptr(), None))
            else:
                slab = owner.slabs.view(("in", i), arg)
                slab.copy_(arg)
                inputs.append(_Input(slab.data_ptr(), slab))
                arg = slab
            call_args.append(arg)
        if (self.fn, size) not in owner.warmed:
            # Lazy kernel compilation and autotuning must not happen inside a capture; they are
            # per compiled function and size, so one instance of identical layers warms up.
            owner.warmed.add((self.fn, size))
            self.fn(*call_args)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, owner.pool):
            out = self.fn(*call_args)
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        owner.fixed_ptrs.update(o.data_ptr() for o in outs)
        self.entries[size] = _Entry(graph, inputs, tuple(unowned_view(o) for o in outs))
        # The forward holds the owning tensors for as long as it uses them, and no longer.
        return out


class PiecewiseGraphs:
    """All pieces' graphs for a list of token buckets. `run_forward(size)` stages a padding-only
    batch of `size` tokens and runs the model (what a capture runs)."""

    def __init__(self, buckets: list[int], pool, fixed: list[torch.Tensor],
                 run_forward: Callable[[int], None]) -> None:
        self.buckets = sorted(buckets)
        self.run_forward = run_forward
        self.pool = pool
        self.slabs = Slabs(self.buckets[-1])
        # Addresses that stay put between steps (the runner's buffers, the attention slab, the
        # pieces' outputs): graph inputs found there are used in place.
        self.fixed_ptrs: set[int] = {t.data_ptr() for t in fixed}
        self.warmed: set[tuple[Callable, int]] = set()  # (compiled function, size) already run once
        self.pieces: list[PieceGraphs] = []
        self.captured: set[int] = set()
        self.capture_seconds = 0.0
        self.replays = 0  # forwards that replayed these graphs (tests check they are used)

    def attach(self, pieces: list) -> None:
        """Give each compiled piece (in forward order) its graphs."""
        for index, piece in enumerate(pieces):
            piece.graphs = PieceGraphs(piece.fn, piece.weight_args, index, self)
            self.pieces.append(piece.graphs)

    def release(self) -> None:
        """Free every piece's captured graphs now (none can replay after)."""
        for piece in self.pieces:
            piece.release()
        self.captured.clear()

    def attention_out(self, q: torch.Tensor) -> torch.Tensor:
        """Where attention writes its output `[T, Hq, D]` (like q), for the next piece to read."""
        out = self.slabs.view(("attention",), q)
        self.fixed_ptrs.add(out.data_ptr())
        return out

    @property
    def pending(self) -> list[int]:
        """The buckets not captured yet, smallest first."""
        return [b for b in self.buckets if b not in self.captured]

    def is_pending(self, size: int) -> bool:
        """Whether `size` is a bucket not captured yet."""
        return size not in self.captured and size in self.buckets

    def capture(self, sizes: Iterable[int] | None = None) -> None:
        """Capture `sizes` (default: every bucket), largest first so smaller ones reuse the pool's
        blocks. A bucket captured later, between two steps, shares the pool as one captured at
        start does (replays run one at a time). Adds its time to `capture_seconds`."""
        from compiled.compilation.warm_up import warm_up_once
        start = time.perf_counter()
        for size in sorted(self.buckets if sizes is None else sizes, reverse=True):
            if size not in self.buckets:
                raise ValueError(f"piecewise CUDA graphs: {size} is not one of the buckets {self.buckets}")
            # Each piece captures; attention, whose outputs only need the right address (its
            # slab), runs once per bucket.
            with forward_context(piecewise=PiecewiseMode(size, capturing=True)), warm_up_once():
                self.run_forward(size)
            self.captured.add(size)
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - start

