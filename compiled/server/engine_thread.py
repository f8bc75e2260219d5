"""The engine on a thread of its own, fed by the HTTP handlers.

Handlers never wait for the engine: they post work (a new request, an abort, an adapter to add)
to an inbox that the engine's thread empties between steps, and read each request's progress from
one asyncio queue per HTTP request. A lock around the engine instead would stall the whole event
loop for as long as a step runs, and a thread that re-takes it at once can hold it for many steps
in a row (locks are not fair), so streams would stall for seconds. The engine is not thread-safe:
only its thread touches it. A request whose client went away is aborted at once, which frees its
KV slots."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from compiled.errors import RequestError
from compiled.runtime.llm import LLM
from compiled.runtime.request import Request

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """What a request has produced since its last report."""
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def followed_by(self, later: Progress) -> Progress:
        """This report and the next one of the same request as one."""
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        return Progress(self.token_ids + later.token_ids, logprobs, later.finished, later.finish_reason,
                        later.stop_reason)


@dataclass
class _Tracked:
    request: Request
    queue: asyncio.Queue          # shared by the requests of one submit
    index: int                    # the request's place in that submit: reports are (index, Progress)
    loop: asyncio.AbstractEventLoop
    sent: int = 0
    posted: float = field(default_factory=time.perf_counter)   # when the handler submitted it
    added: float | None = None                                 # when the engine's thread queued it


# A request's time to its first token, in phases, and what each measures.
FIRST_TOKEN_PHASES = {
    "inbox": "seconds from a handler's post of a request to the engine's queue",
    "queue": "seconds from the engine's queue to the first step computing the request",
    "prefill": "seconds from that step's launch to the first token handed to the handler",
}


@dataclass
class Stats:
    started: float = field(default_factory=time.monotonic)
    requests_finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0   # engine.step wall time, summed (with the front end's load on the GIL)
    first_tokens: int = 0       # requests whose first token was handed on (phase_seconds sums over them)
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FIRST_TOKEN_PHASES, 0.0))


class EngineThread:
    def __init__(self, llm: LLM) -> None:
        self.llm, self.engine = llm, llm.engine
        self._inbox: deque[Callable[[], None]] = deque()   # run by the engine's thread, in order
        self._work = threading.Event()                      # set when the inbox gets something
        self._tracked: dict[int, _Tracked] = {}             # the engine's thread's only
        self._stopping = False
        self.stats = Stats()
        self._thread = threading.Thread(target=self._run, name="compiled-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish every request already submitted, then end the thread."""
        self._stopping = True
        self._work.set()
        self._thread.join(timeout=30)

    # ---- called by the handlers (event loop thread); none of these waits for a step -----------

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn()` on the engine's thread between two steps; its result (or error) in the future."""
        future: Future = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)
        self._post(run)
        return future

    def submit(self, requests: list[Request]) -> asyncio.Queue:
        """Queue `requests` (made by `engine.make_request`); the queue of their reports, each
        `(index in requests, Progress or the Exception that failed it)`."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        tracked = [_Tracked(r, queue, i, loop) for i, r in enumerate(requests)]
        self._post(lambda: self._add(tracked))
        return queue

    def abort(self, request_id: int) -> None:
        self._post(lambda: self._abort(request_id))

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests, as the engine's thread last left them (reading a length
        needs no lock)."""
        scheduler = self.engine.scheduler
        return len(scheduler.running), len(scheduler.waiting)

    def _post(self, work: Callable[[], None]) -> None:
        self._inbox.append(work)
        self._work.set()

    # ---- the engine's thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._work.clear()   # before emptying the inbox: a post after this sets it again
            self._empty_inbox()
            if not self.engine.has_work:
                if self._stopping:
                    return
                # Idle: capture a CUDA-graph bucket left for later at start, one per pass, so
                # that a request arriving meanwhile waits for at most one capture.
                if not self.engine.capture_pending_graphs(at_most=1):
                    self._work.wait()
                continue
            start = time.perf_counter()
            try:
                finished = self.engine.step()
            except Exception as e:   # the step was rolled back: fail its requests, keep serving
                self._fail_all(e)
                continue
            self.stats.steps += 1
            self.stats.step_seconds += time.perf_counter() - start
            self._report(finished)

    def _empty_inbox(self) -> None:
        while self._inbox:
            work = self._inbox.popleft()
            try:
                work()
            except Exception:   # one bad item must not end the thread every request depends on
                log.exception("engine thread: a posted call failed")

    def _add(self, tracked: list[_Tracked]) -> None:
        loras = self.engine.loras
        for t in tracked:
            r = t.request
            if r.lora is not None and (loras is None or r.lora not in loras):
                # unloaded between the handler's check and now
                _deliver({t.loop: [(t.queue, (t.index, RequestError(f"adapter {r.lora!r} was unloaded")))]})
                continue
            self._tracked[r.id] = t
            t.added = time.perf_counter()
            self.engine.add(r)

    def _abort(self, request_id: int) -> None:
        if self._tracked.pop(request_id, None) is not None:
            self.engine.abort(request_id)

    def _report(self, finished: list[Request]) -> None:
        done = {r.id for r in finished}
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, t in list(self._tracked.items()):
            r = t.request
            new = len(r.output_token_ids) - t.sent
            if not new and rid not in done:
                continue
            if not t.sent and new:
                self._first_token(t)
            logprobs = None if r.logprobs is None else list(r.logprobs[t.sent:])
            progress = Progress(list(r.output_token_ids[t.sent:]), logprobs, rid in done, r.finish_reason,
                                r.stop_reason)
            t.sent += new
            self.stats.generation_tokens += new
            if rid in done:
                del self._tracked[rid]
                self.stats.requests_finished += 1
                self.stats.prompt_tokens += len(r.prompt_token_ids)
            batches.setdefault(t.loop, []).append((t.queue, (t.index, progress)))
        _deliver(batches)

    def _first_token(self, t: _Tracked) -> None:
        launched = t.request.first_launched
        if t.added is None or launched is None:
            return
        phases = self.stats.phase_seconds
        phases["inbox"] += t.added - t.posted
        phases["queue"] += launched - t.added
        phases["prefill"] += time.perf_counter() - launched
        self.stats.first_tokens += 1

    def _fail_all(self, error: Exception) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, t in list(self._tracked.items()):
            self.engine.abort(rid)
            batches.setdefault(t.loop, []).append((t.queue, (t.index, error)))
        self._tracked.clear()
        _deliver(batches)


def _deliver(batches: dict[asyncio.AbstractEventLoop, list]) -> None:
    """One wake-up of each event loop a step (a thread-safe call costs ~1 µs of the engine's
    thread; one a request was ~100 µs a step at 96 requests)."""
    for loop, items in batches.items():
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)
