"""Context-parallel steps, on every rank: which chunks of a batch split over the ranks, what rank 0
tells the workers, and the step's forward through the context-parallel graph.

A chunk splits when it has at least `cp_min_tokens` tokens (and two per rank) and every rank holds
the K/V of all the request's tokens before it (`Request.cp_synced`); the other chunks of such a
step run whole on rank 0. Every rank stores the K/V of all the step's tokens, so after a split
prefill each holds the request's whole prompt. Decode and steps without a split chunk run on rank
0 alone: a decode step has one token per request, nothing to split, and running it on every rank
would only add a broadcast to each step. Tokens computed by rank 0 alone are missing on the
workers, so a request's later chunk splits only while nothing before it ran that way."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from compiled.attention.context import AttentionContext, AttentionMetadata
from compiled.forward_context import forward_context
from compiled.parallel.context import CPStep
from compiled.parallel.group import CPGroup
from compiled.parallel.zigzag import ChunkShape, plan
from compiled.runtime.cp_messages import StepChunk
from compiled.runtime.static_inputs import StaticInputs, write_request_table


def split_chunks(batch, world: int, min_tokens: int) -> list[StepChunk] | None:
    """The batch as a context-parallel step, or None when no chunk of it splits."""
    chunks = []
    for c in batch.chunks:
        r = c.request
        split = c.length >= max(min_tokens, 2 * world) and (c.start == 0 or r.cp_synced == c.start)
        chunks.append(StepChunk(r.row, c.start, r.token_ids(c.start, c.start + c.length), c.slots, r.lora_slot,
                                split))
    return chunks if any(c.split for c in chunks) else None


def note_step(batch, on_all_ranks: bool) -> None:
    """After a step ran: which of its requests' tokens every rank now holds."""
    for c in batch.chunks:
        r = c.request
        if on_all_ranks and (c.start == 0 or r.cp_synced == c.start):
            r.cp_synced = c.start + c.length
        else:
            r.cp_synced = min(r.cp_synced, c.start)


class ContextParallelRunner:
    """Runs context-parallel steps on this rank through `model` (the cp_allgather graph)."""

    def __init__(self, group: CPGroup, model: nn.Module, kv, req_pool, inputs: StaticInputs,
                 uses_lora: bool) -> None:
        self.group, self.model, self.kv, self.req_pool, self.inputs = group, model, kv, req_pool, inputs
        self.uses_lora = uses_lora
        self.steps = 0          # context-parallel steps run
        self.split_tokens = 0   # tokens of split chunks among them

    @torch.inference_mode()
    def run(self, chunks: list[StepChunk]) -> torch.Tensor:
        """The step's final hidden states `[T, H]` in batch order (every rank gets them)."""
        device = self.inputs.input_ids.device
        t = self._stage(chunks)
        write_request_table(self.req_pool.table, self.inputs, t)
        shapes, offset = [], 0
        for c in chunks:
            shapes.append(ChunkShape(offset, c.start, c.length, c.split))
            offset += c.length
        p = plan(shapes, self.group.world)
        self.steps += 1
        self.split_tokens += sum(c.length for c in chunks if c.split)
        segments = p.segments[self.group.rank]
        local = torch.from_numpy(p.local_index(self.group.rank)).to(device)
        starts = np.cumsum([0] + [s.length for s in segments])[:-1].tolist()
        rows = [chunks[s.chunk].row for s in segments]
        seq_lens = [s.position + s.length for s in segments]
        ext_lens = [s.length for s in segments]

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        meta = AttentionMetadata(out_cache_loc=self.inputs.out_cache_loc[:t][local], req_pool_indices=dev(rows),
                                 seq_lens=dev(seq_lens), extend_lens=dev(ext_lens), req_pool_indices_cpu=rows,
                                 seq_lens_cpu=seq_lens, extend_lens_cpu=ext_lens, is_decode=False,
                                 extend_start_loc=dev(starts))
        step = CPStep(self.group.data, self.group.world, self.group.rank, p.max_local,
                      torch.from_numpy(p.gather_index).to(device),
                      self.inputs.positions[:t], self.inputs.out_cache_loc[:t],
                      rows_prefix=dev([s.position - shapes[s.chunk].position for s in segments]),
                      rows_start=dev([shapes[s.chunk].offset for s in segments]))
        attention = AttentionContext(meta=meta, kv=self.kv, req_to_token=self.req_pool.table)
        slots = self.inputs.lora_slots[:t][local] if self.uses_lora else None
        with forward_context(attention, slots, cp=step), self.group.collectives():
            return self.model(self.inputs.input_ids[:t][local], self.inputs.positions[:t][local])

    def _stage(self, chunks: list[StepChunk]) -> int:
        """Every token of the step, in batch order, into the static inputs (host, then device)."""
        h = self.inputs.begin()
        t = 0
        for c in chunks:
            n = c.length
            h["input_ids"][t:t + n] = c.token_ids
            h["positions"][t:t + n] = np.arange(c.start, c.start + n)
            h["out_cache_loc"][t:t + n] = c.slots
            h["token_rows"][t:t + n] = c.row
            h["lora_slots"][t:t + n] = c.lora_slot
            t += n
        self.inputs.upload()
        return t
