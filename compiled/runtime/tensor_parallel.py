"""Tensor-parallel steps: every rank runs every forward (SPMD), each over its shards.

Rank 0 schedules, and sends each step to the workers as a `TPStep` (the chunks' tokens, positions
and KV slots, the request-table rows the prefix cache pointed, and, under overlap scheduling, the
device's input ids on the data group) before running it itself; the workers stage it into their
own static buffers and run the same `ModelRunner.forward`, so every rank takes the same path
(decode graph, piecewise bucket, eager) and meets the same all-reduces. Rank 0 alone samples.

Why rank 0 decides rather than every rank scheduling deterministically: the scheduler's inputs
(arrivals, aborts, adapter loads, stop strings found by the detokenizer, sampled tokens) exist
only on rank 0, so deterministic schedulers would need all of them broadcast anyway and would
have to stay bit-identical through every code path; one message a step keeps the workers free of
requests, samplers and tokenizers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from compiled.parallel.group import CPGroup
from compiled.runtime.cp_messages import TPChunk, TPStep
from compiled.runtime.scheduler import Batch, Chunk


def step_message(batch: Batch, sample_rows: Sequence[int], feed: torch.Tensor | None,
                 table_writes: list[tuple[int, int, np.ndarray]],
                 logit_rows: Sequence[tuple[int, int]] = ()) -> TPStep:
    """Rank 0: what the workers need to run `batch` (and the logits asked of it after)."""
    chunks = [TPChunk(c.request.row, c.start, c.request.token_ids(c.start, c.start + c.length), c.slots,
                      c.request.lora_slot) for c in batch.chunks]
    adapters = {c.request.lora_slot: c.request.lora for c in batch.chunks if c.request.lora_slot >= 0}
    return TPStep(chunks, list(sample_rows), feed is not None, table_writes, adapters, list(logit_rows))


def send_step(group: CPGroup, message: TPStep, feed: torch.Tensor | None) -> None:
    """Rank 0: hand the step to every worker (its input ids after it, when they are on the device)."""
    with group.collectives():
        group.send(message)
        if feed is not None:
            dist.broadcast(feed.contiguous(), src=0, group=group.data)


def received_feed(group: CPGroup, message: TPStep, device: torch.device) -> torch.Tensor | None:
    """A worker: the step's input ids from rank 0, when the message says they follow."""
    if not message.feed:
        return None
    feed = torch.empty(sum(len(c.token_ids) for c in message.chunks), dtype=torch.int64, device=device)
    with group.collectives():
        dist.broadcast(feed, src=0, group=group.data)
    return feed


@dataclass
class _SentRequest:
    """The little of a request a worker's runner reads: its row, adapter slot and this step's tokens."""
    row: int
    lora_slot: int
    start: int
    ids: list[int]
    lora: str | None = None

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.ids[start - self.start:end - self.start]


def worker_batch(message: TPStep) -> Batch:
    """A worker: the step as the batch its runner stages."""
    return Batch([Chunk(_SentRequest(c.row, c.lora_slot, c.start, c.token_ids), c.start, len(c.token_ids), c.slots)
                  for c in message.chunks])


def point_rows(table: torch.Tensor, writes: list[tuple[int, int, np.ndarray]]) -> None:
    """A worker: the request-table rows rank 0's scheduler pointed at cached K/V."""
    for row, start, slots in writes:
        table[row, start:start + len(slots)] = torch.from_numpy(slots).to(table.device, table.dtype)
