"""Copies adapters into their GPU slots on a CUDA stream of their own.

A load starts when the engine picks a slot for an adapter (a request at the head of the queue, or
one the engine prefetches for the requests behind it) and runs beside the steps: the step launched
meanwhile does not wait for it, and the request using the slot is admitted once `ready` says the
copy landed. The load stream first waits for the work already queued on the compute stream, so a
step still reading the slot's previous adapter finishes before it is overwritten. On the CPU a
load is a plain copy, ready at once."""

from __future__ import annotations

from collections.abc import Callable

import torch


class SlotLoader:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._done: dict[int, torch.cuda.Event] = {}

    def load(self, slot: int, write: Callable[[], None]) -> None:
        """Run `write` (the copies into `slot`) behind the work queued so far."""
        if self.stream is None:
            write()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            write()
            done = torch.cuda.Event()
            done.record(self.stream)
        self._done[slot] = done

    def wait(self, slot: int) -> None:
        """Block until the last load into `slot` has landed."""
        done = self._done.get(slot)
        if done is not None:
            done.synchronize()

    def ready(self, slot: int) -> bool:
        """Whether the last load into `slot` has landed."""
        done = self._done.get(slot)
        return done is None or done.query()
