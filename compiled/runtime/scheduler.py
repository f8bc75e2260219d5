"""Continuous batching under a token budget: decode first, then chunked prefill of new requests.

Every request is "all its tokens minus those already in the KV cache": a decoding request needs
one, a prefilling one needs the rest of its prompt (in chunks), a retracted one recomputes
everything. Retraction (see `_victim`): a prefilling request never retracts another, it takes the
free slots or waits; only a decoding request without a slot retracts, and it retracts the running
request whose recomputation costs least. A retracted request resumes once all its tokens fit."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import torch

from compiled.attention.kv_cache import KVPool, ReqToTokenPool
from compiled.runtime.prefix_cache import PrefixCache
from compiled.runtime.request import Request

# A waiting request whose uncached tokens begin with at least this many of a prompt the step being
# built completes waits for that prompt's K/V rather than computing them beside it (SGLang's
# in-batch prefix check uses the same 32).
SHARED_PREFIX_WAIT_TOKENS = 32


@dataclass
class Chunk:
    request: Request
    start: int              # first token position computed in this step
    length: int             # tokens computed in this step
    slots: np.ndarray       # their KV slots (host int64)
    readmitted: bool = False  # admitted by this step after a retraction (rollback restores the mark)
    admitted: bool = False    # its request was admitted by this step (possibly after a cached prefix)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the request's tokens, so a new one is sampled."""
        return self.start + self.length == self.request.num_tokens


@dataclass
class Batch:
    chunks: list[Chunk]

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    @property
    def is_decode(self) -> bool:
        return all(c.length == 1 for c in self.chunks)


class Scheduler:
    def __init__(self, kv: KVPool, req_pool: ReqToTokenPool, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_cache: bool = False, max_mixed_step_tokens: int | None = None) -> None:
        self.kv, self.req_pool = kv, req_pool
        # Finished requests' K/V, reused by requests that start with the same tokens (None: off).
        self.cache = PrefixCache(kv) if prefix_cache else None
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # Tokens in all of a step that also decodes (None: the whole budget).
        self.max_mixed_step_tokens = max_mixed_step_tokens
        self.waiting: deque[Request] = deque()
        # Whether a queued request may be admitted now, besides KV and rows (the engine's adapter
        # slots); it may prepare the request for running when it says yes. A request it refuses
        # keeps its place and those behind it may go ahead (the engine sees that it gets its turn).
        self.admit: Callable[[Request], bool] = lambda request: True
        # With tensor-parallel workers, the request-table rows `_point_row` wrote, for them (None: off).
        self.pointed: list | None = None
        self.running: list[Request] = []
        self.num_retractions = 0
        self._retracted: set[int] = set()   # ids of waiting requests that were retracted

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        budget = self.max_num_batched_tokens
        self._retract_for_decode(budget)
        prefill_budget = self._prefill_budget(budget)
        chunks: list[Chunk] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            decoding = self._decoding(request)
            n = min(request.num_tokens - request.num_computed, budget if decoding else min(budget, prefill_budget))
            slots = self._alloc_or_retract(i, n) if n > 0 else None
            if slots is None:
                if i < len(self.running) and self.running[i] is request:
                    i += 1  # a prefill waiting for free slots or for a step with prefill budget left
                continue    # else `request` itself was retracted
            chunks.append(self._chunk(request, len(slots), slots))
            budget -= len(slots)
            prefill_budget -= 0 if decoding else len(slots)
            i += 1
        skipped = 0    # waiting requests passed over in this step: the deferred ones and those refused by admit
        deferred = 0   # of them, those left for the next step, which starts them from this one's K/V
        while len(self.waiting) > skipped and min(budget, prefill_budget) > 0 \
                and len(self.running) + deferred < self.max_num_seqs and skipped < self.max_num_seqs:
            request = self.waiting[skipped]
            if self._waits_for_prompt(request):
                break
            prefix = self._cached_prefix(request)
            n = min(request.num_tokens - (len(prefix) if prefix else 0), budget, prefill_budget)
            held = self._held(request, prefix, n, chunks)
            if held is not None:
                if self.cache is not None:
                    self.cache.release(prefix)
                if held == "no room":
                    break   # first come, first served for memory: a large request is not overtaken
                skipped += 1
                deferred += held == "next step"
                continue
            del self.waiting[skipped]
            readmitted = request.id in self._retracted
            self._retracted.discard(request.id)
            request.row = self.req_pool.alloc()
            if request.num_cached_tokens is None:
                request.num_cached_tokens = len(prefix) if prefix is not None else 0
            if prefix is not None:
                request.prefix, request.num_computed = prefix, len(prefix)
                self._point_row(request.row, 0, prefix.slots)
            self.running.append(request)
            chunks.append(self._chunk(request, n, self._alloc(n)))
            chunks[-1].readmitted, chunks[-1].admitted = readmitted, True
            budget -= n
            prefill_budget -= n
        if not chunks and self.running:
            # Every running request is a prefill waiting for room: the oldest takes what is free,
            # and with nothing free the cheapest gives way to the others.
            request = self.running[0]
            n = min(request.num_tokens - request.num_computed, budget, self._num_free())
            if n > 0:
                return Batch([self._chunk(request, n, self._alloc(n))])
            self.retract(self._victim(self.running))
            return type(self).schedule(self)
        # One-token chunks first: the attention of a mixed step runs them through the decode
        # kernel as one block (`AttentionMetadata.decode_rows`).
        chunks.sort(key=lambda c: c.length != 1)
        return Batch(chunks) if chunks else None

    def _held(self, request: Request, prefix, n: int, chunks: list[Chunk]) -> str | None:
        """Why the queued `request` (with its cached `prefix`, `n` tokens to compute now) is not
        admitted in this step: "next step" (it then starts from K/V this step computes), "no
        room" (KV slots or request rows), "refused" (by `admit`: its adapter has no slot yet);
        None: admit it."""
        if self._shares_with_step(request, prefix, chunks):
            return "next step"
        if not self._fits(request, n) or self.req_pool.num_free == 0:
            return "no room"
        return None if self.admit(request) else "refused"

    def _prefill_budget(self, budget: int) -> int:
        """Prompt tokens this step may compute: all of `budget`, or, when some running requests
        decode, what the mixed-step cap leaves beside their tokens (a long prefill beside decodes
        lengthens every one of their inter-token gaps; alone, it may take the whole budget)."""
        cap = self.max_mixed_step_tokens
        decoding = sum(1 for r in self.running if self._decoding(r))
        if cap is None or not decoding:
            return budget
        return max(min(cap, budget) - decoding, 0)

    def schedule_decode(self) -> Batch | None:
        """One token for every running request, nothing admitted and nothing retracted: the step
        that overlap scheduling launches before the previous one's tokens are known. None when the
        KV cache cannot give each request its slot (the regular schedule then decides)."""
        if not self.running or self._num_free() < len(self.running):
            return None
        return Batch([self._chunk(r, 1, self._alloc(1)) for r in self.running])

    # ---- retraction: when, and whom --------------------------------------------------------

    @staticmethod
    def _decoding(request: Request) -> bool:
        """It needs one token computed to sample its next: it cannot progress in smaller pieces."""
        return request.num_tokens - request.num_computed == 1

    def _victim(self, candidates: list[Request]) -> Request:
        """The request to retract: the one whose recomputation costs least, i.e. with the fewest
        tokens in the KV cache (the newest among equals): a request admitted a few steps ago goes
        before one that has decoded long. Newest first (vLLM's rule) retracts a long prompt part-way
        through its prefill again and again; fewest output tokens first, the longest prompt among
        equals (SGLang's), recomputes more on bench/retraction_stress.py (bench/RESULTS.md)."""
        return min(reversed(candidates), key=lambda r: r.num_computed)

    def _retract_for_decode(self, budget: int) -> None:
        """Before the step is built: while the KV cache cannot give each decoding request that
        runs this step (at most `budget` of them) its one slot, retract the cheapest victim among
        all running requests. This is the only retraction a step makes besides the deadlock one
        in `schedule` (every running request a prefill waiting for slots)."""
        while True:
            need = min(budget, sum(1 for r in self.running if self._decoding(r)))
            if self._num_free() >= need or not self.running:
                return
            self.retract(self._victim(self.running))

    def _alloc_or_retract(self, i: int, n: int) -> np.ndarray | None:
        """Slots for up to `n` tokens of `running[i]`. A prefill never retracts: it takes what is
        free beyond one slot for each decoding request after it in this step and one for each
        running request in the next (as admission keeps), possibly nothing (None: it keeps its KV
        and waits). A decoding request was given room by `_retract_for_decode`; should it still
        lack its slot, the cheapest of it and the requests after it is retracted (None when that
        is itself)."""
        request = self.running[i]
        if not self._decoding(request):
            later = sum(1 for r in self.running[i + 1:] if self._decoding(r))
            n = min(n, self._num_free() - later - len(self.running))
            return self._alloc(n) if n > 0 else None
        while (slots := self._alloc(n)) is None:
            victim = self._victim(self.running[i:])
            self.retract(victim)
            if victim is request:
                return None
        return slots

    def _fits(self, request: Request, n: int) -> bool:
        """Whether the head of the queue may start with `n` tokens, keeping one free slot per
        running request so the next decode step does not retract. A retracted request comes
        back only when all its tokens fit beside what the running requests still need, so that
        its recomputation is not retracted in turn (a retract-readmit loop otherwise)."""
        free = self._num_free() - len(self.running)
        if request.id in self._retracted:
            return free - sum(r.num_tokens - r.num_computed for r in self.running) >= request.num_tokens
        return free >= n

    # ---- KV slots, counting the prefix cache's unlocked slots as free ------------------------

    def _num_free(self) -> int:
        return self.kv.num_free + (self.cache.num_evictable if self.cache is not None else 0)

    def _alloc(self, n: int) -> np.ndarray | None:
        if self.cache is not None and self.kv.num_free < n:
            self.cache.evict(n - self.kv.num_free)
        return self.kv.alloc(n)

    def _cached_prefix(self, request: Request):
        """The request's longest cached prefix, locked; at least its last token is left to compute
        (its logits sample), and a request asking for prompt logprobs computes every position."""
        if self.cache is None or request.params.prompt_logprobs is not None or request.num_tokens < 2:
            return None
        return self.cache.match(request.lora, request.token_ids(0, request.num_tokens - 1))

    def share_prompts(self, batch: Batch) -> None:
        """After `batch` ran: the requests whose prompt it completed put their prompt's K/V into
        the prefix cache, so requests admitted later (the other choices of an `n > 1` request, or
        any with the same start) reuse it while they still run."""
        if self.cache is None:
            return
        for chunk in batch.chunks:
            r = chunk.request
            p = len(r.prompt_token_ids)
            if r.row is None or chunk.start >= p or chunk.start + chunk.length < p or r.num_computed < p \
                    or (r.prefix is not None and len(r.prefix) >= p):
                continue
            owned, start, slots = _slots(r)
            r.prefix, freed, repoint = self.cache.adopt(r.lora, r.prompt_token_ids, slots[:p], r.prefix)
            for position, tree_slots in repoint:
                self._point_row(r.row, position, tree_slots)
            if len(freed):
                self.kv.free(freed)
            r.slots = [owned[p - start:]] if r.num_computed > p else []

    def _waits_for_prompt(self, request: Request) -> bool:
        """With the prefix cache, a request whose prompt (and adapter) a running request has not put
        into the cache yet (still prefilling it, or admitted in this step) waits, then starts from
        its K/V."""
        if self.cache is None or request.params.prompt_logprobs is not None:
            return False
        return any(r.lora == request.lora and (r.prefix is None or len(r.prefix) < len(r.prompt_token_ids))
                   and r.prompt_token_ids == request.prompt_token_ids for r in self.running)

    def _shares_with_step(self, request: Request, prefix, chunks: list[Chunk]) -> bool:
        """With the prefix cache: whether a prompt this step completes (so that `share_prompts`
        caches it once the step is launched) starts with at least SHARED_PREFIX_WAIT_TOKENS of
        `request`'s tokens beyond its cached `prefix`. Such a request waits one step and then starts
        from that K/V instead of computing the same tokens beside it (requests behind it go on)."""
        if self.cache is None or request.params.prompt_logprobs is not None:
            return False
        cached = len(prefix) if prefix is not None else 0
        need = cached + SHARED_PREFIX_WAIT_TOKENS
        if request.num_tokens - 1 < need:
            return False
        tokens = request.token_ids(0, need)
        window = tokens[cached:]
        for c in chunks:
            prompt = c.request.prompt_token_ids
            if c.request.lora != request.lora or c.request.params.prompt_logprobs is not None \
                    or not c.start < len(prompt) <= c.start + c.length:
                continue
            # The tokens past the cached prefix first: prompts behind one cached system prompt
            # differ there, and the prefix itself (1,000 tokens) is then never compared (a burst
            # of 32 admissions spent 21 ms comparing it, CPU).
            if list(prompt[cached:need]) == window and list(prompt[:cached]) == tokens[:cached]:
                return True
        return False

    def _point_row(self, row: int, start: int, slots: np.ndarray) -> None:
        """Positions start.. of the request->token table's `row` read the KV slots `slots`."""
        table = self.req_pool.table
        table[row, start:start + len(slots)] = torch.from_numpy(slots).to(table.device, table.dtype)
        if self.pointed is not None:   # tensor-parallel workers point theirs too
            self.pointed.append((row, start, slots))

    def _chunk(self, request: Request, n: int, slots: np.ndarray) -> Chunk:
        chunk = Chunk(request, request.num_computed, n, slots)
        request.slots.append(slots)
        request.num_computed += n
        return chunk

    def _release(self, request: Request, keep: bool = False) -> None:
        """Give back the request's row and KV slots; `keep`: index its K/V in the prefix cache."""
        owned, start, slots = _slots(request)
        if self.cache is not None and keep and request.num_computed:
            known = min(request.num_computed, request.num_resolved)   # positions whose token is known
            owned = np.concatenate([self.cache.insert(request.lora, request.token_ids(0, known), slots[:known],
                                                      request.prefix),
                                    slots[max(known, start):]])
        elif self.cache is not None:
            self.cache.release(request.prefix)
        request.prefix = None
        if len(owned):
            self.kv.free(owned)
        request.slots = []
        if request.row is not None:
            self.req_pool.free(request.row)
            request.row = None
        _discard(self.running, request)

    def retract(self, request: Request) -> None:
        """Give back the request's KV; it recomputes its tokens when readmitted."""
        self._release(request)
        request.num_computed = 0
        self.waiting.appendleft(request)
        self._retracted.add(request.id)
        self.num_retractions += 1

    def finish(self, request: Request) -> None:
        self._release(request, keep=True)

    def rollback(self, batch: Batch) -> None:
        """Undo the scheduling of `batch`, whose step failed before it completed: each chunk's
        slots go back to the pool and its request's `num_computed` back to the chunk's start, and
        the requests this batch admitted return, in order, to the front of the waiting queue
        with their rows freed. A retraction made while scheduling stands: the victim recomputes,
        as after any retraction."""
        admitted: list[Request] = []
        for chunk in reversed(batch.chunks):
            request = chunk.request
            if not request.slots or request.slots[-1] is not chunk.slots:
                continue  # no longer owns the chunk's slots (retracted or aborted since)
            request.slots.pop()
            self.kv.free(chunk.slots)
            request.num_computed = chunk.start
            if chunk.admitted:  # admitted by this batch (after its cached prefix, if any)
                request.num_computed = 0
                admitted.append(request)
                if chunk.readmitted:  # waits again under the whole-fit rule of a retracted request
                    self._retracted.add(request.id)
        for request in admitted:  # newest first, so the oldest ends up in front
            self._release(request)
            self.waiting.appendleft(request)

    def abort(self, request: Request) -> None:
        """Forget `request` wherever it is: dropped from the waiting queue, or from the running
        batch with its KV slots and row returned to the pools."""
        _discard(self.waiting, request)
        self._retracted.discard(request.id)
        self._release(request)


def _slots(request: Request) -> tuple[np.ndarray, int, np.ndarray]:
    """(the KV slots the request owns, the position they start at, the slots of every position
    from 0: its cached prefix's, then its own)."""
    owned = np.concatenate(request.slots) if request.slots else np.empty(0, np.int64)
    if request.prefix is None:
        return owned, 0, owned
    return owned, len(request.prefix), np.concatenate([request.prefix.slots, owned])


def _discard(queue: deque[Request] | list[Request], request: Request) -> None:
    """Remove `request` (by identity: requests compare by value) from `queue` if it is there."""
    for i, queued in enumerate(queue):
        if queued is request:
            del queue[i]
            return
