"""The engine's constrained requests: their grammars compiled off the engine's thread, each step's
bitmask filled on the host while the step's forward runs on the device, and the tokens they
produce fed to their matchers.

Nothing here runs for a step without a constrained row: its logits, argmax and sampling are
exactly those of an engine that knows nothing of grammars."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

import torch
import xgrammar as xgr

from compiled.errors import RequestError
from compiled.runtime.request import Request
from compiled.structured.bitmask import GrammarMask, bitmask_width
from compiled.structured.compiler import GrammarCache, Vocabulary, vocabulary
from compiled.structured.grammar import check
from compiled.structured.matcher import RequestGrammar
from compiled.structured.spec import StructuredOutputs
from compiled.structured.stats import StructuredStats

# The engine waits this long for a compile when nothing else can run, then returns to its caller.
COMPILE_POLL_SECONDS = 0.05
# Host threads filling a step's masks (a JSON row takes from microseconds to milliseconds).
FILL_THREADS = 8


class Constraints:
    def __init__(self, hf_tokenizer: Any | None, vocab_size: int, eos_token_ids: Sequence[int],
                 max_rows: int, device: torch.device) -> None:
        # What builds the vocabulary's token table (None: no tokenizer, no constrained requests);
        # a benchmark of a model without one may set its own before the first constrained request.
        self.make_vocabulary: Callable[[], Vocabulary] | None = None
        if hf_tokenizer is not None:
            eos = sorted(eos_token_ids)
            self.make_vocabulary = lambda: vocabulary(hf_tokenizer, vocab_size, eos)
        self._device = device
        self._cache: GrammarCache | None = None   # made with the first constrained request
        self._max_rows = max_rows
        self._host: list[torch.Tensor] = []       # two host bitmasks used in turn (pinned on CUDA)
        self._turn = 0
        # Half the host's cores at most: the engine's own thread and the compiles need some.
        self._filler = xgr.BatchGrammarMatcher(max(1, min(FILL_THREADS, (os.cpu_count() or 1) // 2)))
        self.compiling: list[Request] = []        # queued requests whose grammar is not compiled yet
        self.live = 0                             # constrained requests added and not finished

    def _grammars(self) -> GrammarCache:
        if self._cache is None:
            self._cache = GrammarCache(self.make_vocabulary)
        return self._cache

    def make(self, index: int, spec: StructuredOutputs) -> RequestGrammar:
        """Check prompt `index`'s spec (a one-line RequestError naming the field) and start its
        compilation."""
        if self.make_vocabulary is None:
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
        matchers = [requests[i].grammar.matcher for i in rows]
        if len(rows) == 1:
            matchers[0].fill_next_token_bitmask(host, rows[0])
        else:   # on xgrammar's threads, without the GIL
            self._filler.batch_fill_next_token_bitmask(matchers, host, rows)
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
