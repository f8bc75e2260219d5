"""SGLang's KV layout: a request->token table and per-layer token pools (slot 0 reserved).

A request owns a row of `req_to_token`; the row's first `seq_len` entries are the pool slots of
its tokens. Padding tokens write their K/V to slot 0, which no request ever reads."""

from __future__ import annotations

import numpy as np
import torch

PADDING_SLOT = 0


class ReqToTokenPool:
    """Rows of the request->token table, handed out one per running request. One extra row,
    never handed out, serves padded requests of a CUDA-graph bucket (all its slots are 0)."""

    def __init__(self, max_requests: int, max_context: int, device: torch.device) -> None:
        self.table = torch.zeros(max_requests + 1, max_context, dtype=torch.int32, device=device)
        self.padding_row = max_requests
        self._free = list(range(max_requests - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)


class KVPool:
    """Per-layer K and V token pools `[num_slots + 1, kv_heads, head_dim]` with a slot allocator."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots + 1, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        # Attention kernels' scratch buffers (e.g. the decode workspace), allocated on first use
        # (the warm-up step, before any graph capture) and reused by every layer and step.
        self.scratch: dict = {}
        # Host-side free stack: the first `_count` entries are free slots; allocation never
        # touches the device and costs one slice.
        self._free = np.arange(num_slots, 0, -1, dtype=np.int64)
        self._count = num_slots

    @property
    def num_free(self) -> int:
        return self._count

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` free slots (lowest first on a fresh pool), or None when fewer are left."""
        if n > self._count:
            return None
        self._count -= n
        return self._free[self._count:self._count + n][::-1].copy()

    def free(self, slots: np.ndarray) -> None:
        self._free[self._count:self._count + len(slots)] = slots[::-1]
        self._count += len(slots)


def kv_slots_for_memory(free_bytes: int, per_token: int) -> int:
    """How many token slots fit in `free_bytes` (the budget left after weights)."""
    return max(int(free_bytes // per_token) - 1, 0)
