"""The CPU tier's memory: an adapter's factors packed into one block, page-locked in place on a
CUDA machine so that slot loads read them by DMA at the bus's speed.

Factors in pageable memory go to the GPU only through a staging copy on the CPU (loader.py), a
few GB/s for one thread; page-locked ones are read by the copy engines directly. The block is
locked with `cudaHostRegister` rather than allocated page-locked, because the caching host
allocator rounds every block up to a power of two (an expert adapter of Qwen3-30B-A3B, 1.66 GB,
would take 2 GiB) and keeps it after the adapter is gone. The lock is undone when the block is
collected; a load holds its adapter's block until its copies have landed."""

from __future__ import annotations

import ctypes

import torch

from compiled.lora.weights import Adapter, ExpertLoRAWeight, LoRAWeight, stored_rows

ALIGN = 512   # bytes: each factor starts on a DMA-friendly boundary


class HostBlock:
    """One block of host memory holding every factor of an adapter."""

    def __init__(self, nbytes: int) -> None:
        self.data = torch.empty(nbytes, dtype=torch.uint8)
        self.locked = False

    def lock(self) -> bool:
        """Page-lock the block in place; False (and left pageable) when the driver refuses, e.g.
        for lack of lockable memory: loads then take the staging path."""
        if self.locked or self.data.numel() == 0:
            return self.locked
        err = torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), self.data.numel(), 0)
        self.locked = int(err) == 0
        if not self.locked:
            _clear_last_error()
        return self.locked

    def __getstate__(self) -> dict:
        return {"data": self.data, "locked": False}   # a lock does not travel to another process

    def unlock(self) -> None:
        """Undo `lock` (no copy may be reading the block)."""
        if self.locked:
            self.locked = False
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())

    def __del__(self) -> None:
        try:
            self.unlock()
        except Exception:   # the interpreter is shutting down: the process frees it anyway
            pass


def _clear_last_error() -> None:
    """A refused `cudaHostRegister` stays the runtime's last error, which torch's next check after
    a kernel launch would raise as its own: read it back (torch binds no cudaGetLastError)."""
    major = (torch.version.cuda or "").split(".")[0]
    try:   # the runtime torch loaded, found by its soname
        ctypes.CDLL(f"libcudart.so.{major}").cudaGetLastError()
    except (OSError, AttributeError):
        pass


def pack(adapter: Adapter, dtype: torch.dtype) -> Adapter:
    """`adapter` with its factors in `dtype`, every one a view into one `HostBlock` (a factor
    shared by all experts stays one row behind a broadcast view)."""
    factors = list(adapter.factors())
    item = torch.empty((), dtype=dtype).element_size()
    offsets, end = [], 0
    for f in factors:
        offsets.append(end)
        end += -(-stored_rows(f).numel() * item // ALIGN) * ALIGN
    block = HostBlock(end)
    views = iter(_place(block.data, off, f, dtype, item) for off, f in zip(offsets, factors))
    packed = Adapter(adapter.name, adapter.path, adapter.rank, host=block, shard=adapter.shard)
    for key, w in adapter.dense.items():
        packed.dense[key] = LoRAWeight(next(views), next(views), w.scaling)
    for key, w in adapter.experts.items():
        packed.experts[key] = ExpertLoRAWeight(next(views), next(views), w.scaling)
    return packed


def _place(data: torch.Tensor, offset: int, f: torch.Tensor, dtype: torch.dtype, item: int) -> torch.Tensor:
    """`f` copied into `data` at `offset` as `dtype` (`item` bytes an element): a view of the
    block, broadcast again where `f` was."""
    src = stored_rows(f)
    view = data[offset:offset + src.numel() * item].view(dtype).view(src.shape)
    view.copy_(src)
    return view.expand(f.shape) if src is not f else view
