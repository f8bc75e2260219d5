"""The step's static inputs: every integer the model reads per step, in one device buffer at its
maximum sizes, staged through one pinned host buffer, so a step costs one host->device copy and
a CUDA graph can replay over the same addresses."""

from __future__ import annotations

import numpy as np
import torch

from compiled.attention.kv_cache import PADDING_SLOT

# One entry per token / per request of the step, in this order in the packed buffers.
# lora_slots: each token's adapter slot (-1: none), read by the LoRA graph's deltas.
TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc", "token_rows", "lora_slots")
SEQ_FIELDS = ("req_pool_indices", "seq_lens", "extend_lens", "extend_start_loc")


class StaticInputs:
    """Every integer the model reads per step. `host[name]` are numpy views of the pinned staging
    buffer; the attributes of the same names are the device views the model reads."""

    def __init__(self, max_tokens: int, max_seqs: int, device: torch.device) -> None:
        # Every field starts 16-byte aligned (an even count of int64s before it): Triton compiles
        # a kernel once per alignment of its pointers, and a decode step's graphs and a mixed
        # step's decode rows should run the same compiled decode attention.
        tokens, seqs = max_tokens + max_tokens % 2, max_seqs + max_seqs % 2
        sizes = [(f, tokens) for f in TOKEN_FIELDS] + [(f, seqs) for f in SEQ_FIELDS]
        total = sum(n for _, n in sizes)
        on_gpu = device.type == "cuda"
        self._host = torch.zeros(total, dtype=torch.int64, pin_memory=on_gpu)
        self._device = torch.zeros(total, dtype=torch.int64, device=device) if on_gpu else self._host
        # The copy reads the pinned buffer after the host moved on: wait for it before refilling.
        self._copied = torch.cuda.Event() if on_gpu else None
        host = self._host.numpy()
        self.host: dict[str, np.ndarray] = {}
        offset = 0
        for name, n in sizes:
            setattr(self, name, self._device[offset:offset + n])
            self.host[name] = host[offset:offset + n]
            offset += n

    def begin(self) -> dict[str, np.ndarray]:
        if self._copied is not None:
            self._copied.synchronize()
        return self.host

    def upload(self) -> None:
        if self._device is not self._host:
            self._device.copy_(self._host, non_blocking=True)
            self._copied.record()

    def pad_decode(self, tokens: int, bucket: int, padding_row: int) -> None:
        """Rows [tokens, bucket) become one-token requests on the padding row writing KV slot 0."""
        h = self.host
        self._pad_tokens(tokens, bucket, padding_row)
        h["req_pool_indices"][tokens:bucket] = padding_row
        h["seq_lens"][tokens:bucket] = 1
        h["extend_lens"][tokens:bucket] = 1
        h["extend_start_loc"][tokens:bucket] = np.arange(tokens, bucket)

    def pad_extend(self, tokens: int, seqs: int, bucket: int, padding_row: int) -> None:
        """Tokens [tokens, bucket) become one more request (index `seqs`) on the padding row: a
        fresh prompt of `bucket - tokens` tokens, all at position 0 and KV slot 0."""
        h, n = self.host, bucket - tokens
        self._pad_tokens(tokens, bucket, padding_row)
        h["req_pool_indices"][seqs] = padding_row
        h["seq_lens"][seqs] = n
        h["extend_lens"][seqs] = n
        h["extend_start_loc"][seqs] = tokens

    def pad_requests(self, seqs: int, upto: int, tokens: int, padding_row: int) -> None:
        """Requests [seqs, upto) become empty ones on the padding row (no tokens, nothing cached):
        a launch captured for `upto` requests finds nothing to do for them."""
        h = self.host
        h["req_pool_indices"][seqs:upto] = padding_row
        h["seq_lens"][seqs:upto] = 0
        h["extend_lens"][seqs:upto] = 0
        h["extend_start_loc"][seqs:upto] = tokens

    def _pad_tokens(self, start: int, end: int, padding_row: int) -> None:
        h = self.host
        h["input_ids"][start:end] = 0
        h["positions"][start:end] = 0
        h["out_cache_loc"][start:end] = PADDING_SLOT
        h["token_rows"][start:end] = padding_row
        h["lora_slots"][start:end] = -1


def write_request_table(table: torch.Tensor, inputs: StaticInputs, tokens: int) -> None:
    """Record each new token's KV slot in its request's row of the request->token table."""
    table[inputs.token_rows[:tokens], inputs.positions[:tokens]] = inputs.out_cache_loc[:tokens].to(table.dtype)
