"""The engine's constrained requests: their grammars compiled off the engine's thread, each step's
bitmask filled on the host while the step's forward runs on the device, and the tokens they
produce fed to their matchers.

Nothing here runs for a step without a constrained row: its logits, argmax and sampling are
exactly those of an engine that knows nothing of grammars."""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from compiled.errors import RequestError
from compiled.runtime.request import Request
from compiled.structured.bitmask import GrammarMask, bitmask_width
from compiled.structured.compiler import GrammarCache, vocabulary
from compiled.structured.grammar import check
from compiled.structured.matcher import RequestGrammar
from compiled.structured.spec import StructuredOutputs
from compiled.structured.stats import StructuredStats

# The engine waits this long for a compile when nothing else can run, then returns to its caller.
COMPILE_POLL_SECONDS = 0.05


class Constraints:
    def __init__(self, hf_tokenizer: Any | None, vocab_size: int, eos_token_ids: Sequence[int],
                 max_rows: int, device: torch.device) -> None:
        self._hf, self._vocab_size, self._eos = hf_tokenizer, vocab_size, sorted(eos_token_ids)
        self._device = device
        self._cache: GrammarCache | None = None   # made with the first constrained request
        self._max_rows = max_rows
        self._host: list[torch.Tensor] = []       # two host bitmasks used in turn (pinned on CUDA)
        self._turn = 0
        self.compiling: list[Request] = []        # queued requests whose grammar is not compiled yet
        self.live = 0                             # constrained requests added and not finished

    def _grammars(self) -> GrammarCache:
        if self._cache is None:
            hf, size, eos = self._hf, self._vocab_size, self._eos
            self._cache = GrammarCache(lambda: vocabulary(hf, size, eos))
        return self._cache

    def make(self, index: int, spec: StructuredOutputs) -> RequestGrammar:
        """Check prompt `index`'s spec (a one-line RequestError naming the field) and start its
        compilation."""
        if self._hf is None:
            raise RequestError(f"prompt {index}: structured_outputs needs the model's tokenizer, which it has not")
        try:
            check(spec)
        except ValueError as e:
            raise RequestError(f"prompt {index}: {e}") from None
        cache = self._grammars()
        return RequestGrammar(spec, cache.get(spec), cache.vocabulary_future)

    def added(self, request: Request) -> None:
        self.live += 1
        self.compiling.append(request)   # until a step sees it compiled (or failed)

    def ended(self, request: Request) -> None:
        self.live -= 1
        if self.compiling:   # by identity: requests compare by value
            self.compiling = [r for r in self.compiling if r is not request]

    def failed(self) -> list[Request]:
        """The queued requests whose compilation failed (each `grammar.error` says why); those
        compiled are no longer waited for."""
        failed = [r for r in self.compiling if r.grammar.ready and r.grammar.error is not None]
        self.compiling = [r for r in self.compiling if not r.grammar.ready]
        if failed:
            self._cache.stats.failures += len(failed)
        return failed

    def wait(self) -> bool:
        """Nothing else can run: wait a little for the oldest compilation; False when none runs."""
        if not self.compiling:
            return False
        self.compiling[0].grammar.wait(COMPILE_POLL_SECONDS)
        return True

    def mask(self, requests: Sequence[Request]) -> GrammarMask | None:
        """The bitmask of this step's rows (None when no row is constrained now), filled on the
        host and sent to the device behind the launched forward."""
        rows = [i for i, r in enumerate(requests)
                if r.grammar is not None and not r.finished and r.grammar.active]
        if not rows:
            return None
        start = time.perf_counter()
        host = self._host_bitmask()[:len(requests)]
        for i in rows:
            requests[i].grammar.fill(host, i)
        on_device = host if self._device.type != "cuda" else host.to(self._device, non_blocking=True)
        self._cache.stats.masked(len(rows), time.perf_counter() - start)
        return GrammarMask(on_device, rows)

    def _host_bitmask(self) -> torch.Tensor:
        if not self._host:
            width = bitmask_width(self._grammars().vocabulary().size)
            self._host = [torch.zeros(self._max_rows, width, dtype=torch.int32,
                                      pin_memory=self._device.type == "cuda") for _ in range(2)]
        self._turn ^= 1
        return self._host[self._turn]

    def stats(self) -> StructuredStats:
        return StructuredStats() if self._cache is None else self._cache.stats.snapshot()

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
