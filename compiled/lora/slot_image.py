"""An adapter in the CPU tier, laid out as one slot of the pool's buffers.

Each of the pool's `[S, ...]` buffers gets a host view shaped like one slot of it, in the buffer's
dtype, ranks already zero-padded: copying an adapter into a slot is then one copy per buffer. On a
GPU machine the views share one flat host block per dtype, page-locked in place
(`cudaHostRegister`: the caching host allocator would round each block up to a power of two), so
those copies run asynchronously on the loader's stream; from pageable memory each copy blocks the
host (an expert adapter of Qwen3-30B-A3B, 1.66 GB: ~0.3 s, stalling the step being launched)."""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)


class SlotImage:
    def __init__(self, buffers: list[torch.Tensor], pin: bool) -> None:
        self._blocks: dict[torch.dtype, torch.Tensor] = {}
        sizes: dict[torch.dtype, int] = {}
        for buf in buffers:
            sizes[buf.dtype] = sizes.get(buf.dtype, 0) + math.prod(buf.shape[1:])
        offsets = dict.fromkeys(sizes, 0)
        self.views: list[torch.Tensor] = []   # per buffer, one slot's worth: [...] of buffers[i]'s dtype
        for dtype, n in sizes.items():
            self._blocks[dtype] = torch.zeros(n, dtype=dtype)
        for buf in buffers:
            n = math.prod(buf.shape[1:])
            start = offsets[buf.dtype]
            self.views.append(self._blocks[buf.dtype][start:start + n].view(buf.shape[1:]))
            offsets[buf.dtype] = start + n
        self._registered: list[int] = []
        if pin:
            self._pin()

    @property
    def pinned(self) -> bool:
        return len(self._registered) == len(self._blocks)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._blocks.values())

    def _pin(self) -> None:
        cudart = torch.cuda.cudart()
        for block in self._blocks.values():
            if not block.numel():
                continue
            err = cudart.cudaHostRegister(block.data_ptr(), block.numel() * block.element_size(), 0)
            if int(err) != 0:
                log.warning("could not page-lock an adapter's host copy (CUDA error %s): its loads will block the "
                            "host", int(err))
                return
            self._registered.append(block.data_ptr())

    def __del__(self) -> None:
        if self._registered:
            try:
                cudart = torch.cuda.cudart()
                for ptr in self._registered:
                    cudart.cudaHostUnregister(ptr)
            except Exception:   # interpreter shutdown: CUDA may be gone already
                pass
