"""A launched step whose sampled tokens have not been read back yet (overlap scheduling).

The engine launches step N+1 before it reads step N's tokens, so the host work of a step
(schedule, stage, sampler set-up, detokenize, stop checks) runs while the GPU computes. Each
step's tokens are copied into pinned host memory right behind its sampler on the stream, and an
event marks the copy: reading them waits for that step alone, never for the step queued after it
(a plain `.tolist()` would synchronise the whole stream)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiled.runtime.request import Request


@dataclass
class InFlight:
    requests: list[Request]       # the rows that sampled, in batch order
    token_ids: torch.Tensor       # [B] int64 on the device: feeds the next step's input ids
    logprobs: list                # per row, as the sampler returned them
    host: torch.Tensor            # [B] int64 (pinned on CUDA) the tokens are copied into
    copied: torch.cuda.Event | None
    num_read: int = 0             # rows whose tokens were appended to their requests
    _tokens: list[int] | None = None

    def tokens(self) -> list[int]:
        # Kept once read: a step whose reading was interrupted may outlive its turn of `host`.
        if self._tokens is None:
            if self.copied is not None:
                self.copied.synchronize()
            self._tokens = self.host.tolist()
        return self._tokens


class TokenReadback:
    """Two pinned buffers used in turn: at most two steps are unread at once (the one being
    resolved and the one just launched)."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.on_gpu = device.type == "cuda"
        self.buffers = [torch.empty(max_rows, dtype=torch.int64, pin_memory=self.on_gpu) for _ in range(2)]
        self.events = [torch.cuda.Event() if self.on_gpu else None for _ in range(2)]
        self.turn = 0

    def start(self, requests: list[Request], token_ids: torch.Tensor, logprobs: list) -> InFlight:
        host, event = self.buffers[self.turn][:len(requests)], self.events[self.turn]
        self.turn ^= 1
        host.copy_(token_ids, non_blocking=self.on_gpu)
        if event is not None:
            event.record()
        return InFlight(requests, token_ids, logprobs, host, event)
