"""A second CUDA stream for work that may run beside the current stream's (a LoRA shrink beside the
alignment or the base GEMM it does not depend on), forked from and joined back to the current one.

    fork = Fork(x.device)
    with fork.side():
        ...                   # starts after everything queued so far on the current stream
    ...                       # the current stream goes on meanwhile
    fork.join()               # the current stream waits for the side's work

Inside a CUDA graph capture the fork and join become the graph's edges. Tensors the side work
reads must stay alive until the join (an op's inputs do: it joins before it returns). A tensor
the side work allocates belongs to the side stream's pool: once freed, its memory is reused only
by later side work, which the next fork orders after everything the current stream had queued,
its readers included. Off CUDA both parts run in order on the one host thread."""

from __future__ import annotations

import contextlib

import torch

_SIDE: dict[torch.device, torch.cuda.Stream] = {}


class Fork:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            self.stream = _SIDE.get(device)
            if self.stream is None:
                self.stream = _SIDE[device] = torch.cuda.Stream(device)
            self.stream.wait_stream(self.main)

    def side(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def join(self) -> None:
        if self.cuda:
            self.main.wait_stream(self.stream)
