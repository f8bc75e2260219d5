"""A completion's choices as the engine's reports come in: each choice's state (its text decoded
here, its stop strings, its tokens, logprobs and usage so far), folded the same way whether the
response streams or not, and the wait for the next reports of an HTTP request's engine requests."""

from __future__ import annotations

import asyncio

from fastapi import Request as HTTPRequest

from compiled.runtime.detokenizer import IncrementalDetokenizer
from compiled.runtime.stop import StopChecker
from compiled.runtime.tokenizer import Tokenizer
from compiled.server.messages import Progress, Submitted
from compiled.server.protocol import APIError


class ChoiceState:
    """One choice (one engine request) of a response: what the engine reported of it so far.

    Its text is decoded here token by token and checked for its stop strings in the order the
    engine's own check has (`Engine._append`): from `min_new_tokens` on, on tokens the engine
    did not itself end the request at (its end of sequence and stop token ids come first).
    Without a tokenizer there is no text."""

    def __init__(self, request: Submitted, tokenizer: Tokenizer | None) -> None:
        self.request = request
        params = request.params
        self.detokenizer = None if tokenizer is None else \
            IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        self.stops = StopChecker.of(params)
        self._hold_back = 0 if self.stops is None else self.stops.hold_back_chars
        self.text = ""
        self.stop_reason: str | None = None   # the stop string found here that ended the text
        self.tokens: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list | None = None
        self.cached: int | None = None        # prompt tokens the prefix cache held (its first report's)
        self.last: Progress | None = None     # its last report, once finished
        self.streamed = 0                     # characters of its text streamed so far
        self.started = False                  # whether a chunk of it was streamed

    @property
    def finished(self) -> bool:
        return self.last is not None

    def fold(self, p: Progress) -> Progress:
        """Fold report `p` in; returns it as the client sees it. A stop string completed here ends
        the choice as the engine would have: the report ends after the token that completed the
        string (tokens the engine made past it are dropped)."""
        kept = self._decode(p)
        if self.stop_reason is not None:
            p = Progress(p.token_ids[:kept], None if p.logprobs is None else p.logprobs[:kept], True, "stop",
                         self.stop_reason, p.prompt_logprobs, p.cached_tokens)
        self.tokens += p.token_ids
        self.logprobs += p.logprobs or []
        self.prompt_logprobs = self.prompt_logprobs or p.prompt_logprobs
        self.cached = self.cached if self.cached is not None else p.cached_tokens
        if p.finished:
            self.last = p
        return p

    def _decode(self, p: Progress) -> int:
        """Decode p's tokens; how many of them the choice keeps (all but those past a stop string)."""
        if self.detokenizer is None:
            return len(p.token_ids)
        for j, token in enumerate(p.token_ids):
            delta = self.detokenizer.step(token)
            self.text += delta
            if self.stops is None:
                continue
            ended_by_engine = p.finished and j == len(p.token_ids) - 1 and p.finish_reason == "stop"
            hit = None if ended_by_engine else self.stops.check(self.text, delta, len(self.tokens) + j + 1)
            if hit is not None:
                self.text, self.stop_reason = hit.text, hit.stop_str
                return j + 1
        return len(p.token_ids)

    def unsent_text(self) -> str:
        """The text not streamed yet, but for what might still begin a stop string (all of it
        once the choice finished)."""
        upto = max(self.streamed, len(self.text) - (0 if self.last is not None else self._hold_back))
        delta, self.streamed = self.text[self.streamed:upto], upto
        return delta


class Generation:
    """The engine requests of one HTTP request (one a choice) and the queue of their reports, with
    a watch that wakes it when its client goes away. `close` aborts what is still running."""

    def __init__(self, http: HTTPRequest, engine, requests: list[Submitted], queue: asyncio.Queue,
                 tokenizer: Tokenizer | None) -> None:
        self.engine, self.queue = engine, queue
        self.choices = [ChoiceState(r, tokenizer) for r in requests]
        self.done: set[int] = set()   # the choices finished
        self._watch = asyncio.ensure_future(watch_disconnect(http, queue))

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.choices)

    async def next(self) -> list[tuple[int, Progress]]:
        """The next reports, each folded into its choice: (choice index, report as the client sees it)."""
        folded = []
        for i, p in await next_reports(self.queue, self.done):
            choice = self.choices[i]
            p = choice.fold(p)
            folded.append((i, p))
            if p.finished:
                self.done.add(i)
                if choice.stop_reason is not None:   # ended here: the engine drops it
                    self.engine.abort(choice.request.id)
        return folded

    def close(self) -> None:
        self._watch.cancel()
        for c in self.choices:
            self.engine.abort(c.request.id)   # a no-op for finished requests


async def next_reports(queue: asyncio.Queue, done: set[int]) -> list[tuple[int, Progress]]:
    """The next reports of an HTTP request's engine requests: waits for one, then takes every one
    already queued with it, merged per request, so that a front end behind the engine handles
    (and streams) several steps' tokens as one event instead of one event each. Requests in
    `done` are skipped (the engine's reports past a stop string found here)."""
    batch = [await queue.get()]
    while not queue.empty():
        batch.append(queue.get_nowait())
    merged: dict[int, Progress] = {}
    for index, item in batch:
        if index is None:
            raise asyncio.CancelledError   # the client went away (`watch_disconnect`)
        if index in done:
            continue
        if isinstance(item, Exception):
            raise APIError(500, f"the engine failed this request: {item}")
        merged[index] = merged[index].followed_by(item) if index in merged else item
    return list(merged.items())


async def watch_disconnect(http: HTTPRequest, queue: asyncio.Queue) -> None:
    """Wake the handler with (None, None) when its client goes away (one task a request, rather
    than a timeout on every wait for a token)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait((None, None))
