"""Runs one batch through the model: fills the static input buffers, installs the attention
context, and returns final hidden states for the rows the engine asked for.

The buffers are allocated once at their maximum size and written in place each step, so the
compile issue can capture CUDA graphs over them unchanged."""

from __future__ import annotations

import torch

from compiled.attention.context import AttentionMetadata, ForwardContext, forward_context
from compiled.attention.kv_cache import KVPool, ReqToTokenPool
from torch import nn
from compiled.runtime.config import EngineConfig
from compiled.runtime.scheduler import Batch


class StaticInputs:
    """Every tensor the model reads per step, at its maximum size."""

    def __init__(self, max_tokens: int, max_seqs: int, device: torch.device) -> None:
        def buf(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.out_cache_loc = buf(max_tokens), buf(max_tokens), buf(max_tokens)
        self.req_pool_indices, self.seq_lens, self.extend_lens = buf(max_seqs), buf(max_seqs), buf(max_seqs)


class ModelRunner:
    def __init__(self, model: nn.Module, cfg: EngineConfig, kv: KVPool, req_pool: ReqToTokenPool) -> None:
        self.model, self.cfg, self.kv, self.req_pool = model, cfg, kv, req_pool
        self.inputs = StaticInputs(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.device)
        self.graphs = None  # DecodeGraphs once captured

    def capture_graphs(self, buckets: list[int]) -> float:
        """Capture the decode CUDA graphs; returns the seconds it took."""
        from compiled.runtime.cuda_graphs import DecodeGraphs
        graphs = DecodeGraphs(self.model, self, buckets)
        graphs.capture()
        self.graphs = graphs
        return graphs.capture_seconds

    def _stage(self, batch: Batch) -> AttentionMetadata:
        ids, positions, rows, seq_lens, ext_lens, starts = [], [], [], [], [], []
        for c in batch.chunks:
            starts.append(len(ids))
            ids += c.request.all_token_ids[c.start:c.start + c.length]
            positions += range(c.start, c.start + c.length)
            rows.append(c.request.row)
            seq_lens.append(c.start + c.length)
            ext_lens.append(c.length)
        slots = torch.cat([c.slots for c in batch.chunks])
        t, b = len(ids), len(rows)
        inp, dev = self.inputs, self.cfg.device
        # Host lists -> one copy per buffer; the table update is a single scatter.
        inp.input_ids[:t].copy_(torch.tensor(ids), non_blocking=True)
        inp.positions[:t].copy_(torch.tensor(positions), non_blocking=True)
        inp.out_cache_loc[:t].copy_(slots, non_blocking=True)
        inp.req_pool_indices[:b].copy_(torch.tensor(rows), non_blocking=True)
        inp.seq_lens[:b].copy_(torch.tensor(seq_lens), non_blocking=True)
        inp.extend_lens[:b].copy_(torch.tensor(ext_lens), non_blocking=True)
        table_rows = torch.tensor([c.request.row for c in batch.chunks for _ in range(c.length)], device=dev)
        self.req_pool.table[table_rows, inp.positions[:t]] = inp.out_cache_loc[:t].to(torch.int32)
        return AttentionMetadata(
            out_cache_loc=inp.out_cache_loc[:t], req_pool_indices=inp.req_pool_indices[:b],
            seq_lens=inp.seq_lens[:b], extend_lens=inp.extend_lens[:b],
            req_pool_indices_cpu=rows, seq_lens_cpu=seq_lens, extend_lens_cpu=ext_lens,
            is_decode=batch.is_decode,
            extend_start_loc=None if batch.is_decode else torch.tensor(starts).to(dev, non_blocking=True),
        )

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Final hidden states `[T, H]` of every token in the batch, in chunk order."""
        meta = self._stage(batch)
        t = batch.num_tokens
        if self.graphs is not None and batch.is_decode and t <= self.graphs.max_batch:
            return self.graphs.replay(t)
        ctx = ForwardContext(meta=meta, kv=self.kv, req_to_token=self.req_pool.table)
        with forward_context(ctx):
            return self.model(self.inputs.input_ids[:t], self.inputs.positions[:t])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()
