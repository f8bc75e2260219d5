"""Copies adapters into their GPU slots without holding up the steps.

A load starts when the engine picks a slot for an adapter (a request at the head of the queue, or
one the engine prefetches for the requests behind it). It is a list of `SlotWrite`s (zero a slot's
buffer, set a scale, copy a factor) that a thread of its own carries out on a CUDA stream of its
own, so neither the engine's thread nor its steps wait: the request using the slot is admitted
once `ready` says the copy landed. The load stream first waits for the work queued on the compute
stream when the load was asked for, so a step still reading the slot's previous adapter finishes
before it is overwritten.

A load from page-locked memory (the CPU tier's blocks on a GPU machine, host.py) is a list of
asynchronous copies the thread queues at once: straight into the slot where its view is
contiguous, else into a GPU staging buffer that a copy kernel writes into its place (ranks below
the pool's leave strided views; a factor shared by all experts is sent once and broadcast on the
GPU). The job holds the adapter's block, so its lock outlives the copies. Factors in pageable
memory (a block the driver would not lock) go, in pieces, through a ring of page-locked buffers
first: a copy from pageable memory would block the thread for the whole transfer (an expert
adapter of Qwen3-30B-A3B is 1.66 GB in bf16; done on the engine's thread, such loads put the
serving bench's inter-token p99 at 302 ms, bench/RESULTS.md). Without `background` (on the CPU)
a load is plain copies, done when `load` returns; so are a context-parallel worker's
(`LoRAPool.place`)."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import torch

from compiled.lora.host import HostBlock
from compiled.lora.weights import stored_rows

# The ring: this many page-locked buffers of this many bytes each (and as many on the GPU), so
# that copying one piece into the ring overlaps the transfer of the pieces before it.
STAGING_BUFFERS = 4
STAGING_BYTES = 8 << 20


@dataclass(frozen=True)
class SlotWrite:
    """One write of a load: `dst.zero_()` (src None, value None), `dst.fill_(value)`, or
    `dst.copy_(src)` with src on the CPU (a factor of shape `dst.shape`, or a broadcast view of
    one along dim 0)."""
    dst: torch.Tensor
    src: torch.Tensor | None = None
    value: float | None = None

    def run(self) -> None:
        """Write directly (a pageable copy on a GPU blocks until it lands)."""
        if self.src is not None:
            self.dst.copy_(self.src)
        elif self.value is not None:
            self.dst.fill_(self.value)
        else:
            self.dst.zero_()


@dataclass(eq=False)
class _Load:
    slot: int
    writes: list[SlotWrite]
    after: torch.cuda.Event | None          # the compute stream's work when the load was asked for
    source: HostBlock | None                # the factors' block: page-locked ones are sent directly
    enqueued: threading.Event = field(default_factory=threading.Event)   # every copy is queued
    done: torch.cuda.Event | None = None    # recorded on the load stream after the last copy
    error: BaseException | None = None


class SlotLoader:
    def __init__(self, device: torch.device, background: bool | None = None) -> None:
        self.device = device
        self.background = device.type == "cuda" if background is None else background
        self._loads: dict[int, _Load] = {}   # the last load asked for, per slot
        self._queue: queue.Queue[_Load] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self._cuda else None
        self._host: list[torch.Tensor] = []    # the page-locked ring (ordinary memory on a CPU)
        self._staged: list[torch.Tensor] = []  # a device buffer per ring buffer
        self._freed: list[torch.cuda.Event | None] = []   # when each ring buffer's transfer has read it

    def load(self, slot: int, writes: list[SlotWrite], source: HostBlock | None = None) -> None:
        """Carry out `writes` (everything that puts one adapter into `slot`, its factors in
        `source` if given) behind the work queued so far: in the background, or here and now
        without `background`."""
        if not self.background:
            write_now(writes)
            return
        after = None
        if self._cuda:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        job = _Load(slot, writes, after, source)
        self._loads[slot] = job
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="compiled-lora-loader", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def ready(self, slot: int) -> bool:
        """Whether the last load into `slot` has landed; raises what failed it."""
        job = self._loads.get(slot)
        if job is not None and job.enqueued.is_set() and job.error is not None:
            raise job.error
        return not self.in_flight(slot)

    def in_flight(self, slot: int) -> bool:
        """Whether a load into `slot` is still under way (one that failed is not)."""
        job = self._loads.get(slot)
        if job is None:
            return False
        if not job.enqueued.is_set():
            return True
        return job.error is None and job.done is not None and not job.done.query()

    def wait(self, slot: int) -> None:
        """Block until the last load into `slot` has landed; raises what failed it."""
        job = self._loads.get(slot)
        if job is None:
            return
        job.enqueued.wait()
        if job.error is not None:
            raise job.error
        if job.done is not None:
            job.done.synchronize()

    # ---- the loader's thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            locked = job.source is not None and job.source.locked
            try:
                if self._cuda:
                    with torch.cuda.stream(self.stream), torch.no_grad():
                        self.stream.wait_event(job.after)
                        self._carry_out(job.writes, locked)
                        job.done = torch.cuda.Event()
                        job.done.record(self.stream)
                else:
                    with torch.no_grad():
                        self._carry_out(job.writes, locked)
            except BaseException as e:   # reported to whoever asks about the slot
                job.error = e
            finally:
                job.enqueued.set()

    def _carry_out(self, writes: list[SlotWrite], locked: bool) -> None:
        turn = 0
        for w in writes:
            if w.src is None:
                w.run()
                continue
            src = stored_rows(w.src)   # a factor shared by every expert: sent once, broadcast by the copy kernel
            if locked and src is w.src and w.dst.is_contiguous():
                w.dst.copy_(src, non_blocking=True)
                continue
            for dst_part, src_part in _parts(w.dst, src):
                dst_part.copy_(self._stage(turn % STAGING_BUFFERS, src_part, locked))
                turn += 1

    def _stage(self, i: int, part: torch.Tensor, locked: bool) -> torch.Tensor:
        """`part` sent to GPU staging buffer `i`: directly when `locked`, else through ring
        buffer `i` (on the CPU: into that buffer)."""
        if not self._host:
            self._make_ring()
        n = part.numel() * part.element_size()
        if not locked:
            if self._freed[i] is not None:
                self._freed[i].synchronize()   # the transfer that last read this buffer
            host = self._host[i][:n].view(part.dtype).view(part.shape)
            host.copy_(part)
            if not self._cuda:
                return host
            part = host
        staged = self._staged[i][:n].view(part.dtype).view(part.shape)
        staged.copy_(part, non_blocking=True)
        if locked:
            return staged
        if self._freed[i] is None:
            self._freed[i] = torch.cuda.Event()
        self._freed[i].record(self.stream)
        return staged

    def _make_ring(self) -> None:
        pin = self._cuda
        self._host = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=pin) for _ in range(STAGING_BUFFERS)]
        self._staged = [torch.empty(STAGING_BYTES, dtype=torch.uint8, device=self.device)
                        for _ in range(STAGING_BUFFERS)]
        self._freed = [None] * STAGING_BUFFERS


@torch.no_grad()
def write_now(writes: list[SlotWrite]) -> None:
    """Carry out `writes` here, in order."""
    for w in writes:
        w.run()


def _parts(dst: torch.Tensor, src: torch.Tensor):
    """(dst, src) views of at most `STAGING_BYTES` of src each, cut along src's first dimension
    longer than one (src may be one row that dst broadcasts along dim 0)."""
    size = src.numel() * src.element_size()
    if size <= STAGING_BYTES or src.numel() <= 1:
        yield dst, src
        return
    d = next(i for i, n in enumerate(src.shape) if n > 1)
    n = src.shape[d]
    step = max(STAGING_BYTES // (size // n), 1)
    for start in range(0, n, step):
        length = min(step, n - start)
        yield from _parts(dst.narrow(d, start, length), src.narrow(d, start, length))
