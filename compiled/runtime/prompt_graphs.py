"""A lone prompt's prefill step as one CUDA graph per token bucket: the request table's writes, the
whole forward (the compiled pieces and the attention between them) and the logits of the prompt's
last token, replayed with one launch.

The piecewise graphs (`compilation/piecewise_graphs.py`) leave attention to run eagerly between
pieces, so the host launches two kernels and replays a graph a layer, and the GPU waits on it at
the step's start, before the host is far enough ahead. A step of one chunk (a prompt, or a part of
one, with no decode rows beside it) needs nothing of that: its batch is laid out as two requests in
the runner's static inputs, the chunk first, then the padding request over the bucket's remaining
tokens (an empty one where the chunk fills the bucket). Attention's launches are sized by the
bucket (the extend kernel's programs past a request's new tokens exit at once) and read lengths
and offsets from the device, so nothing the graph holds changes between steps.

The extend kernel's tiles are chosen at capture for a prefix of at most `MAX_PREFIX` tokens
(`triton_extend.default_config`); a chunk after a longer one runs the piecewise graphs, with
tiles for its prefix."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from compiled.attention.context import AttentionContext, AttentionMetadata
from compiled.attention.triton_extend import SHORT_PREFIX
from compiled.compilation.bucket_graphs import BucketGraphs
from compiled.forward_context import forward_context
from compiled.runtime.decode_graphs import compute_logits
from compiled.runtime.static_inputs import StaticInputs, write_request_table

MAX_PREFIX = SHORT_PREFIX
REQUESTS = 2   # the chunk's request and the padding request


class PromptGraphs(BucketGraphs):
    """Per token bucket: the step of one chunk, staged by `stage(chunks, bucket)` into `inputs`
    (the runner's) as REQUESTS requests. `replay` returns the hidden states `[bucket, H]` and the
    fp32 logits `[1, V]` of the chunk's last token, views of buffers the next replay overwrites."""

    def __init__(self, model: nn.Module, head: nn.Module, kv, req_pool, inputs: StaticInputs,
                 stage: Callable[[list, int], None], lora_slots: torch.Tensor | None, buckets: list[int],
                 pool, device: torch.device) -> None:
        super().__init__(buckets, pool)
        self.model, self.head, self.kv, self.req_pool = model, head, kv, req_pool
        self.inputs, self.stage, self.lora_slots = inputs, stage, lora_slots
        self.logits = torch.empty(1, head.out_features, dtype=torch.float32, device=device)
        self.replays = 0

    def serves(self, chunks: list, sample_rows: list[int]) -> int | None:
        """The bucket that runs a step of `chunks` sampling `sample_rows` (indices into its
        tokens), or None where this step is not one for these graphs."""
        if len(chunks) != 1 or chunks[0].start > MAX_PREFIX:
            return None
        tokens = chunks[0].length
        if sample_rows and sample_rows != [tokens - 1]:
            return None
        return self.bucket_for(tokens)

    def _meta(self, size: int) -> AttentionMetadata:
        """What attention is launched for: a bucket-long chunk without prefix (the host lists are
        only the launches' sizes; the kernels read the step's lengths from `inputs`)."""
        inp, n = self.inputs, REQUESTS
        return AttentionMetadata(
            out_cache_loc=inp.out_cache_loc[:size], req_pool_indices=inp.req_pool_indices[:n],
            seq_lens=inp.seq_lens[:n], extend_lens=inp.extend_lens[:n],
            req_pool_indices_cpu=[self.req_pool.padding_row] * n, seq_lens_cpu=[size] + [0] * (n - 1),
            extend_lens_cpu=[size] + [0] * (n - 1), is_decode=False, extend_start_loc=inp.extend_start_loc[:n])

    @contextlib.contextmanager
    def prepare(self, size: int):
        self.stage([], size)
        with forward_context(AttentionContext(self._meta(size), self.kv, self.req_pool.table), self.lora_slots):
            yield

    def step(self, size: int) -> torch.Tensor:
        inp = self.inputs
        write_request_table(self.req_pool.table, inp, size)
        hidden = self.model(inp.input_ids[:size], inp.positions[:size])
        last = inp.extend_lens[:1] - 1   # the chunk's last token (it starts the batch)
        compute_logits(self.head, hidden.index_select(0, last), self.logits)
        return hidden

    def replay(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the chunk staged (padded to `bucket`) in `inputs`."""
        self.replays += 1
        return self.replay_graph(bucket), self.logits
