"""The decode step as CUDA graphs: one full-forward graph per batch-size bucket, replayed each step.

Everything a graph reads lives in static buffers; a batch of B decode requests is padded (on the
host, in the same upload) to the smallest bucket >= B. Padded rows read and write only the
reserved padding request row and KV slot 0, so they never touch a real request."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from compiled.attention.context import AttentionContext, AttentionMetadata
from compiled.compilation.bucket_graphs import BucketGraphs
from compiled.forward_context import forward_context
from compiled.linear.ops import SkinnyLinear, use_kernel
from compiled.runtime.argmax import ArgmaxWorkspace, argmax_triton
from compiled.runtime.static_inputs import StaticInputs, write_request_table


def compute_logits(head: nn.Module, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The LM head's logits of `hidden` `[T, H]` in fp32 (into `out` if given), rounded to the
    model's dtype as HF's are. A SkinnyLinear head writes them in fp32 itself (no cast launch)."""
    if out is None:
        out = hidden.new_empty((hidden.shape[0], head.out_features), dtype=torch.float32)
    if isinstance(head, SkinnyLinear):
        return head.forward_into(hidden, out)
    return out.copy_(head(hidden))


class DecodeGraphs(BucketGraphs):
    """Per bucket: write the request table, run the model, and write the fp32 logits of every
    row and their argmax (greedy's tokens, `argmax.py`) into static buffers shared by all buckets
    (one replay at a time reads them, until the next replay overwrites them). The graphs read
    their step's integers from a staging buffer of their own, sized for the largest bucket: the
    runner's is sized for a prefill (max_num_batched_tokens per field), and uploading all of it
    took ~7 µs a decode step (H100, bench/RESULTS.md)."""

    def __init__(self, model: nn.Module, kv, req_pool, buckets: list[int], pool, device: torch.device) -> None:
        super().__init__(buckets, pool)
        self.model, self.kv, self.req_pool = model, kv, req_pool
        self.inputs = StaticInputs(self.max_batch, self.max_batch, device)
        self.logits = torch.empty(self.max_batch, model.lm_head.out_features, dtype=torch.float32, device=device)
        self.argmax = torch.empty(self.max_batch, dtype=torch.int64, device=device)
        self.argmax_workspace = ArgmaxWorkspace(self.max_batch, device)

    def _meta(self, batch: int) -> AttentionMetadata:
        inp = self.inputs
        rows = [self.req_pool.padding_row] * batch
        return AttentionMetadata(
            out_cache_loc=inp.out_cache_loc[:batch], req_pool_indices=inp.req_pool_indices[:batch],
            seq_lens=inp.seq_lens[:batch], extend_lens=inp.extend_lens[:batch],
            req_pool_indices_cpu=rows, seq_lens_cpu=[1] * batch, extend_lens_cpu=[1] * batch, is_decode=True,
            extend_start_loc=inp.extend_start_loc[:batch])

    @contextlib.contextmanager
    def prepare(self, size: int):
        inp = self.inputs
        inp.begin()
        inp.pad_decode(0, size, self.req_pool.padding_row)
        inp.upload()
        with forward_context(AttentionContext(self._meta(size), self.kv, self.req_pool.table), inp.lora_slots):
            yield

    def step(self, size: int) -> torch.Tensor:
        inp = self.inputs
        write_request_table(self.req_pool.table, inp, size)
        hidden = self.model(inp.input_ids[:size], inp.positions[:size])
        head, logits, argmax = self.model.lm_head, self.logits[:size], self.argmax[:size]
        if isinstance(head, SkinnyLinear) and use_kernel(hidden, head.weight):   # it stores fp32 itself
            compute_logits(head, hidden, logits)
            argmax_triton(logits, self.argmax_workspace, out=argmax)
        else:   # logits in the model's dtype (cuBLAS's): the argmax widens them into the buffer as it reads
            argmax_triton(head(hidden), self.argmax_workspace, out=argmax, widened=logits)
        return hidden

    def replay(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the decode batch staged (and padded to `bucket`) in `inputs`; returns hidden states,
        logits and their argmax `[bucket, ...]`."""
        hidden = self.replay_graph(bucket)
        return hidden, self.logits[:bucket], self.argmax[:bucket]
