"""CUDA graphs for decode: one full-forward graph per batch-size bucket, replayed each step.

Everything a graph reads lives in the runner's static buffers; a batch of B decode requests is
padded (on the host, in the same upload) to the smallest bucket >= B. Padded rows read and write
only the reserved padding request row and KV slot 0, so they never touch a real request. Buckets
are captured largest first in one shared memory pool."""

from __future__ import annotations

import time

import torch
from compiled.attention.context import AttentionMetadata, ForwardContext, forward_context
from compiled.runtime.argmax import ArgmaxWorkspace, argmax_triton
from compiled.runtime.config import smallest_bucket
from compiled.runtime.model_runner import StaticInputs, compute_logits, write_request_table

DEFAULT_MAX_BATCH = 256


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every 8 up to `max_batch` (as vLLM does)."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """Per bucket: write the request table, run the model, and write the fp32 logits of every
    row and their argmax (greedy's tokens, `argmax.py`) into static buffers shared by all buckets
    (one replay at a time reads them, until the next replay overwrites them). The graphs read
    their step's integers from a staging buffer of their own, sized for the largest bucket: the
    runner's is sized for a prefill (max_num_batched_tokens per field), and uploading all of it
    took ~7 µs a decode step (H100, RESULTS.md)."""

    def __init__(self, runner, buckets: list[int], pool) -> None:
        self.runner, self.model = runner, runner.model
        self.buckets = sorted(buckets)
        self.inputs = StaticInputs(self.max_batch, self.max_batch, runner.cfg.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.logits = torch.empty(self.max_batch, runner.model.lm_head.weight.shape[0], dtype=torch.float32,
                                  device=runner.cfg.device)
        self.argmax = torch.empty(self.max_batch, dtype=torch.int64, device=runner.cfg.device)
        self.argmax_workspace = ArgmaxWorkspace(self.max_batch, runner.cfg.device)
        self.pool = pool
        self.capture_seconds = 0.0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, batch: int) -> int | None:
        return smallest_bucket(self.buckets, batch)

    def _meta(self, batch: int) -> AttentionMetadata:
        inp = self.inputs
        rows = [self.runner.req_pool.padding_row] * batch
        return AttentionMetadata(
            out_cache_loc=inp.out_cache_loc[:batch], req_pool_indices=inp.req_pool_indices[:batch],
            seq_lens=inp.seq_lens[:batch], extend_lens=inp.extend_lens[:batch],
            req_pool_indices_cpu=rows, seq_lens_cpu=[1] * batch, extend_lens_cpu=[1] * batch, is_decode=True,
            extend_start_loc=inp.extend_start_loc[:batch])

    def _step(self, batch: int) -> torch.Tensor:
        inp = self.inputs
        write_request_table(self.runner.req_pool.table, inp, batch)
        hidden = self.model(inp.input_ids[:batch], inp.positions[:batch])
        compute_logits(self.model.lm_head, hidden, self.logits[:batch])
        argmax_triton(self.logits[:batch], self.argmax_workspace, out=self.argmax[:batch])
        return hidden

    @torch.inference_mode()
    def capture(self) -> None:
        from compiled.runtime.compiler import warm_up_once  # imported late: it pulls in the split's fx/fake machinery
        start = time.perf_counter()
        inp = self.inputs
        for batch in sorted(self.buckets, reverse=True):
            inp.begin()
            inp.pad_decode(0, batch, self.runner.req_pool.padding_row)
            inp.upload()
            ctx = ForwardContext(self._meta(batch), self.runner.kv, self.runner.req_pool.table)
            with forward_context(ctx):
                with warm_up_once():
                    self._step(batch)  # lazy allocations, compiles and autotuning happen outside the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    hidden = self._step(batch)
            self.graphs[batch], self.hidden[batch] = graph, hidden
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start

    def replay(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the decode batch staged (and padded to `bucket`) in `inputs`; returns hidden states,
        logits and their argmax `[bucket, ...]`."""
        self.graphs[bucket].replay()
        return self.hidden[bucket], self.logits[:bucket], self.argmax[:bucket]
