"""CUDA graphs for decode: one full-forward graph per batch-size bucket, replayed each step.

Everything a graph reads lives in the runner's static buffers; a batch of B decode requests is
padded to the smallest bucket >= B. Padded rows read and write only the reserved padding request
row and KV slot 0, so they never touch a real request. Buckets are captured largest first in one
shared memory pool."""

from __future__ import annotations

import time

import torch
from torch import nn

from compiled.attention.context import AttentionMetadata, ForwardContext, forward_context
from compiled.attention.kv_cache import PADDING_SLOT

DEFAULT_MAX_BATCH = 256


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every 8 up to `max_batch` (as vLLM does)."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model: nn.Module, runner, buckets: list[int]) -> None:
        self.model, self.runner = model, runner
        self.buckets = sorted(buckets)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def _pad(self, start: int, end: int) -> None:
        inp = self.runner.inputs
        if end <= start:
            return
        inp.input_ids[start:end].zero_()
        inp.positions[start:end].zero_()
        inp.out_cache_loc[start:end].fill_(PADDING_SLOT)
        inp.req_pool_indices[start:end].fill_(self.runner.req_pool.padding_row)
        inp.seq_lens[start:end].fill_(1)
        inp.extend_lens[start:end].fill_(1)

    def _meta(self, batch: int) -> AttentionMetadata:
        inp = self.runner.inputs
        rows = [self.runner.req_pool.padding_row] * batch
        return AttentionMetadata(
            out_cache_loc=inp.out_cache_loc[:batch], req_pool_indices=inp.req_pool_indices[:batch],
            seq_lens=inp.seq_lens[:batch], extend_lens=inp.extend_lens[:batch],
            req_pool_indices_cpu=rows, seq_lens_cpu=[1] * batch, extend_lens_cpu=[1] * batch, is_decode=True)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        inp = self.runner.inputs
        for batch in sorted(self.buckets, reverse=True):
            self._pad(0, batch)
            ctx = ForwardContext(self._meta(batch), self.runner.kv, self.runner.req_pool.table)
            with forward_context(ctx):
                self.model(inp.input_ids[:batch], inp.positions[:batch])  # warm-up: lazy allocations
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self.model(inp.input_ids[:batch], inp.positions[:batch])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch], self.outputs[batch] = graph, out
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start

    def replay(self, batch: int) -> torch.Tensor:
        """Run the staged decode batch of `batch` requests; returns hidden states `[batch, H]`."""
        bucket = self.bucket_for(batch)
        self._pad(batch, bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:batch]
