"""The engine's loop in its own process (`engine_process.serve_engine` runs it): messages from the
front end (requests to add, aborts, calls) go into an inbox that the loop empties between steps,
and each step's new tokens go back in one message.

The front end never waits for a step and never shares a lock (or the GIL) with it: the engine's
host work runs at its own pace while the HTTP handlers parse, detokenize and stream. The engine is
not thread-safe: only the loop's thread touches it."""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from compiled.errors import CompiledError

log = logging.getLogger(__name__)

# A request's time to its first token, in phases, and what each measures.
FIRST_TOKEN_PHASES = {
    "inbox": "seconds from a handler's post of a request to the engine's queue",
    "queue": "seconds from the engine's queue to the first step computing the request",
    "prefill": "seconds from that step's launch to the first token sent to the front end",
}


@dataclass
class Progress:
    """What a request has produced since its last report (in its first report also its prompt's
    logprobs, when it asked for them: one entry a prompt token, None for the first; and how many
    prompt tokens came from the prefix cache)."""
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cached_tokens: int | None = None   # in its first report: prompt tokens found in the prefix cache

    def followed_by(self, later: Progress) -> Progress:
        """This report and the next one of the same request as one."""
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        cached = self.cached_tokens if self.cached_tokens is not None else later.cached_tokens
        return Progress(self.token_ids + later.token_ids, logprobs, later.finished, later.finish_reason,
                        later.stop_reason, self.prompt_logprobs or later.prompt_logprobs, cached)


@dataclass
class Stats:
    started: float = field(default_factory=time.monotonic)
    requests_finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0   # engine.step wall time, summed
    first_tokens: int = 0       # requests whose first token was sent (phase_seconds sums over them)
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FIRST_TOKEN_PHASES, 0.0))


@dataclass
class _Tracked:
    request: object               # the engine's Request
    posted: float                 # when the handler posted it (perf_counter: one clock for all processes on Linux)
    added: float = 0.0            # when the loop queued it
    sent: int = 0                 # output tokens reported so far


def picklable(error: BaseException) -> BaseException:
    """`error` if it crosses to the front end's process intact, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class EngineLoop:
    """Steps `llm.engine` while it has work; `send(message)` carries each message to the front end.

    In: ("add", [(key, prompt ids, SamplingParams, adapter, posted)]), ("abort", key),
    ("call", call id, name, args), ("stop",) (finish what was added, then return), ("gone",)
    (the front end went away: drop everything, return). Out: ("reports", [(key, token ids,
    logprobs, finished, finish reason, stop reason, prompt logprobs or None, cached prompt tokens
    or None) or (key, error message)], (running, waiting, requests added so far)) after each step
    that produced something, ("reply", call id, error or None, value) for each call."""

    def __init__(self, llm, send: Callable[[tuple], None]) -> None:
        self.llm, self.engine, self._send = llm, llm.engine, send
        self._inbox: deque[tuple] = deque()
        self._work = threading.Event()          # set when the inbox gets something
        self._tracked: dict[int, _Tracked] = {}  # by the front end's key
        self._added = 0
        self._stopping = False
        self.stats = Stats()
        self._calls: dict[str, Callable] = {"metrics": self._metrics, "unload_lora": llm.unload_lora}

    def post(self, message: tuple) -> None:
        """Called from any thread: `message` runs on the loop's thread between two steps."""
        self._inbox.append(message)
        self._work.set()

    def run(self) -> None:
        while True:
            self._work.clear()   # before emptying the inbox: a post after this sets it again
            if not self._empty_inbox():
                return
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

    # ---- the inbox -----------------------------------------------------------------------------

    def _empty_inbox(self) -> bool:
        """Handle every queued message; False once the front end is gone."""
        while self._inbox:
            message = self._inbox.popleft()
            kind = message[0]
            try:
                if kind == "gone":
                    return False
                if kind == "stop":
                    self._stopping = True
                elif kind == "add":
                    self._add(message[1])
                elif kind == "abort":
                    self._abort(message[1])
                elif kind == "call":
                    self._call(*message[1:])
                elif kind == "added_lora":
                    self._add_lora(*message[1:])
            except Exception:   # one bad message must not end the loop every request depends on
                log.exception("engine loop: handling %r failed", kind)
        return True

    def _add(self, items: list[tuple]) -> None:
        errors = []
        for key, ids, params, lora, posted in items:
            self._added += 1
            try:
                request = self.engine.make_request(0, ids, params, lora, detokenize=False)
            except (CompiledError, ValueError, TypeError) as e:   # e.g. its adapter was unloaded meanwhile
                errors.append((key, str(e)))
                continue
            self._tracked[key] = _Tracked(request, posted, time.perf_counter())
            self.engine.add(request)
        if errors:
            self._send(("reports", errors, self._counts()))

    def _abort(self, key: int) -> None:
        t = self._tracked.pop(key, None)
        if t is not None:
            self.engine.abort(t.request.id)

    def _call(self, call_id: int, name: str, args: tuple) -> None:
        if name == "load_lora":
            # The adapter's files are read on a thread of their own, beside the steps; the loop
            # serves it once read.
            threading.Thread(target=self._read_lora, args=(call_id, *args), daemon=True).start()
            return
        try:
            self._reply(call_id, None, self._calls[name](*args))
        except Exception as e:
            self._reply(call_id, e, None)

    def _read_lora(self, call_id: int, name: str, path: str) -> None:
        try:
            self.post(("added_lora", call_id, self.llm.read_lora(name, path), None))
        except Exception as e:
            self.post(("added_lora", call_id, None, e))

    def _add_lora(self, call_id: int, adapter, error: Exception | None) -> None:
        if error is None:
            try:
                self.llm.add_lora(adapter)
            except Exception as e:
                error = e
        self._reply(call_id, error, None)

    def _reply(self, call_id: int, error: Exception | None, value) -> None:
        self._send(("reply", call_id, None if error is None else picklable(error), value))

    # ---- what goes back ------------------------------------------------------------------------

    def _counts(self) -> tuple[int, int, int]:
        scheduler = self.engine.scheduler
        return len(scheduler.running), len(scheduler.waiting), self._added

    def _report(self, finished: list) -> None:
        done = {r.id for r in finished}
        items = []
        for key, t in list(self._tracked.items()):
            r = t.request
            new = len(r.output_token_ids) - t.sent
            if not new and r.id not in done:
                continue
            first = not t.sent
            if first and new:
                self._first_token(t)
            logprobs = None if r.logprobs is None else r.logprobs[t.sent:]
            items.append((key, r.output_token_ids[t.sent:], logprobs, r.id in done, r.finish_reason, r.stop_reason,
                          r.prompt_logprobs if first else None, (r.num_cached_tokens or 0) if first else None))
            t.sent += new
            self.stats.generation_tokens += new
            if r.id in done:
                del self._tracked[key]
                self.stats.requests_finished += 1
                self.stats.prompt_tokens += len(r.prompt_token_ids)
        if items:
            self._send(("reports", items, self._counts()))

    def _first_token(self, t: _Tracked) -> None:
        launched = t.request.first_launched
        if launched is None:
            return
        phases = self.stats.phase_seconds
        phases["inbox"] += t.added - t.posted
        phases["queue"] += launched - t.added
        phases["prefill"] += time.perf_counter() - launched
        self.stats.first_tokens += 1

    def _fail_all(self, error: Exception) -> None:
        message = f"{type(error).__name__}: {error}"
        items = []
        for key, t in list(self._tracked.items()):
            self.engine.abort(t.request.id)
            items.append((key, message))
        self._tracked.clear()
        if items:
            self._send(("reports", items, self._counts()))

    def _metrics(self) -> dict:
        """What `/metrics` shows of the engine: request counts, KV and prefix-cache use, totals."""
        running, waiting, _ = self._counts()
        kv, cache = self.engine.kv, self.engine.scheduler.cache
        st = self.stats
        return {"running": running, "waiting": waiting,
                "kv_in_use": (kv.num_used - (cache.num_evictable if cache is not None else 0)) / kv.num_slots,
                "prefix_cache_tokens": cache.num_cached if cache is not None else 0,
                "prefix_cache_hit_rate": cache.hit / cache.queried if cache is not None and cache.queried else 0.0,
                "requests_finished": st.requests_finished, "prompt_tokens": st.prompt_tokens,
                "generation_tokens": st.generation_tokens,
                "generation_tokens_per_second": st.generation_tokens / max(time.monotonic() - st.started, 1e-9),
                "steps": st.steps, "step_seconds": st.step_seconds, "first_tokens": st.first_tokens,
                "phase_seconds": dict(st.phase_seconds)}
