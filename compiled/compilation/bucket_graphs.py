"""CUDA graphs of the whole forward, one per batch-size bucket (decode), replayed each step.

What the graphs read and write lives in the runtime's static buffers: a subclass says how to
stage a padding-only batch of a bucket's size (`prepare`) and what one step runs (`step`).
Buckets are captured largest first in one shared memory pool, so smaller ones reuse its blocks.
A bucket may be captured later than the others (`capture([size])`, between two steps): the pool
then already holds the largest bucket's blocks, and replays run one at a time, so any graph's
temporaries may share memory with any other's."""

from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager, Iterable

import torch

from compiled.compilation.buckets import smallest_bucket
from compiled.compilation.warm_up import warm_up_once


def capturing(graph: torch.cuda.CUDAGraph, pool) -> ContextManager:
    """Capture into `graph`. Only this thread's calls are checked against the capture: another
    thread (the LoRA slot loader's) may copy, record and wait on its own stream meanwhile, which
    under the default global check would end the capture with an error."""
    return torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")


class BucketGraphs:
    def __init__(self, buckets: list[int], pool) -> None:
        self.buckets = sorted(buckets)
        self.pool = pool
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Any] = {}   # what the step returned at capture, per bucket
        self.capture_seconds = 0.0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, batch: int) -> int | None:
        return smallest_bucket(self.buckets, batch)

    @property
    def pending(self) -> list[int]:
        """The buckets not captured yet, smallest first."""
        return [b for b in self.buckets if b not in self.graphs]

    def is_pending(self, size: int) -> bool:
        """Whether `size` is a bucket not captured yet."""
        return size not in self.graphs and size in self.buckets

    @torch.inference_mode()
    def capture(self, sizes: Iterable[int] | None = None) -> None:
        """Capture `sizes` (default: every bucket), largest first; per bucket, inside
        `prepare(size)`: `step(size)` once outside the graph (lazy allocations, compiles and
        autotuning), then once captured. Adds its time to `capture_seconds`."""
        start = time.perf_counter()
        for size in sorted(self.buckets if sizes is None else sizes, reverse=True):
            if size not in self.buckets:
                raise ValueError(f"CUDA graphs: {size} is not one of the buckets {self.buckets}")
            with self.prepare(size):
                with warm_up_once():
                    self.step(size)
                graph = torch.cuda.CUDAGraph()
                with capturing(graph, self.pool):
                    self.outputs[size] = self.step(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - start

    def prepare(self, size: int) -> ContextManager:
        """Stage a padding-only batch of `size` and enter whatever the step runs under."""
        return contextlib.nullcontext()

    def step(self, size: int) -> Any:
        """One step over the first `size` rows of the static buffers; returns its outputs."""
        raise NotImplementedError

    def release(self) -> None:
        """Free every captured graph now (none can replay after)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def replay_graph(self, bucket: int) -> Any:
        """Replay `bucket`'s graph; returns the outputs its capture left in place."""
        self.graphs[bucket].replay()
        return self.outputs[bucket]
