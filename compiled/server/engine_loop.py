"""The engine's loop in its own process (`engine_process.serve_engine` runs it): messages from the
front end (`messages.py`: requests to add, aborts, calls) go into an inbox that the loop empties
between steps, and each step's new tokens go back in one message.

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

from compiled.compilation.triton_cache import counting_compiles
from compiled.errors import CompiledError
from compiled.server.messages import (
    FIRST_TOKEN_PHASES, Abort, Add, Call, Counts, Failures, GetMetrics, Gone, LoadLora, LoraRead, MetricsSnapshot,
    Progress, Reply, Reports, Stop, UnloadLora,
)

log = logging.getLogger(__name__)


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


class _Ended(Exception):
    """Raised by a handler to end the loop (the front end is gone)."""


class EngineLoop:
    """Steps `llm.engine` while it has work; `send(message)` carries each message (`messages.py`)
    to the front end: `Reports` or `Failures` after each step that produced something, a `Reply`
    for each `Call`. `Stop` ends the loop once what was added finished; `Gone` at once."""

    def __init__(self, llm, send: Callable[[object], None]) -> None:
        self.llm, self.engine, self._send = llm, llm.engine, send
        self._inbox: deque = deque()
        self._work = threading.Event()          # set when the inbox gets something
        self._tracked: dict[int, _Tracked] = {}  # by the front end's key
        self._added = 0
        self._stopping = False
        self.stats = Stats()
        self._kernels: dict | None = None       # Triton kernels compiled / loaded since `run` began
        # Every message the loop takes, by type. A call's handler returns its reply's value.
        self._handlers: dict[type, Callable] = {
            Add: self._add, Abort: self._abort, Stop: self._stop, Gone: self._gone,
            LoadLora: self._load_lora, LoraRead: self._add_lora,
            UnloadLora: self._answering(lambda m: llm.unload_lora(m.name)),
            GetMetrics: self._answering(lambda m: self._metrics()),
        }

    def post(self, message: object) -> None:
        """Called from any thread: `message` runs on the loop's thread between two steps."""
        self._inbox.append(message)
        self._work.set()

    def run(self) -> None:
        # A kernel compiled while serving holds up every running request: /metrics counts them.
        with counting_compiles() as kernels:
            self._kernels = kernels
            self._serve()

    def _serve(self) -> None:
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
            try:
                handler = self._handlers.get(type(message))
                if handler is not None:
                    handler(message)
                elif isinstance(message, Call):
                    self._reply(message.call_id, KeyError(type(message).__name__), None)
                else:
                    log.error("engine loop: unknown message %r", message)
            except _Ended:
                return False
            except Exception:   # one bad message must not end the loop every request depends on
                log.exception("engine loop: handling %r failed", type(message).__name__)
        return True

    def _answering(self, compute: Callable[[Call], object]) -> Callable[[Call], None]:
        """A handler replying to its call with what `compute` returns, or with the error it raised."""
        def handle(message: Call) -> None:
            try:
                value = compute(message)
            except Exception as e:
                self._reply(message.call_id, e, None)
            else:
                self._reply(message.call_id, None, value)
        return handle

    def _stop(self, _: Stop) -> None:
        self._stopping = True

    def _gone(self, _: Gone) -> None:
        raise _Ended

    def _add(self, message: Add) -> None:
        errors = {}
        for r in message.requests:
            self._added += 1
            try:
                request = self.engine.make_request(0, r.prompt_token_ids, r.params, r.lora, detokenize=False)
            except (CompiledError, ValueError, TypeError) as e:   # e.g. its adapter was unloaded meanwhile
                errors[r.id] = str(e)
                continue
            self._tracked[r.id] = _Tracked(request, message.posted, time.perf_counter())
            self.engine.add(request)
        if errors:
            self._send(Failures(errors, self._counts()))

    def _abort(self, message: Abort) -> None:
        t = self._tracked.pop(message.key, None)
        if t is not None:
            self.engine.abort(t.request.id)

    def _load_lora(self, message: LoadLora) -> None:
        # The adapter's files are read on a thread of their own, beside the steps; the loop
        # serves it once read.
        threading.Thread(target=self._read_lora, args=(message,), daemon=True).start()

    def _read_lora(self, message: LoadLora) -> None:
        try:
            self.post(LoraRead(self.llm.read_lora(message.name, message.path), None, call_id=message.call_id))
        except Exception as e:
            self.post(LoraRead(None, e, call_id=message.call_id))

    def _add_lora(self, message: LoraRead) -> None:
        error = message.error
        if error is None:
            try:
                self.llm.add_lora(message.adapter)
            except Exception as e:
                error = e
        self._reply(message.call_id, error, None)

    def _reply(self, call_id: int, error: Exception | None, value) -> None:
        self._send(Reply(call_id, None if error is None else picklable(error), value))

    # ---- what goes back ------------------------------------------------------------------------

    def _counts(self) -> Counts:
        scheduler = self.engine.scheduler
        return Counts(len(scheduler.running), len(scheduler.waiting), self._added)

    def _report(self, finished: list) -> None:
        done = {r.id for r in finished}
        progress = {}
        for key, t in list(self._tracked.items()):
            r = t.request
            new = len(r.output_token_ids) - t.sent
            if not new and r.id not in done:
                continue
            first = not t.sent
            if first and new:
                self._first_token(t)
            logprobs = None if r.logprobs is None else r.logprobs[t.sent:]
            progress[key] = Progress(r.output_token_ids[t.sent:], logprobs, r.id in done, r.finish_reason,
                                     r.stop_reason, r.prompt_logprobs if first else None,
                                     (r.num_cached_tokens or 0) if first else None)
            t.sent += new
            self.stats.generation_tokens += new
            if r.id in done:
                del self._tracked[key]
                self.stats.requests_finished += 1
                self.stats.prompt_tokens += len(r.prompt_token_ids)
        if progress:
            self._send(Reports(progress, self._counts()))

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
        errors = {}
        for key, t in list(self._tracked.items()):
            self.engine.abort(t.request.id)
            errors[key] = message
        self._tracked.clear()
        if errors:
            self._send(Failures(errors, self._counts()))

    def _metrics(self) -> MetricsSnapshot:
        counts = self._counts()
        kv, cache = self.engine.kv, self.engine.scheduler.cache
        st = self.stats
        return MetricsSnapshot(
            running=counts.running, waiting=counts.waiting,
            kv_in_use=(kv.num_used - (cache.num_evictable if cache is not None else 0)) / kv.num_slots,
            prefix_cache_tokens=cache.num_cached if cache is not None else 0,
            prefix_cache_hit_rate=cache.hit / cache.queried if cache is not None and cache.queried else 0.0,
            requests_finished=st.requests_finished, prompt_tokens=st.prompt_tokens,
            generation_tokens=st.generation_tokens,
            generation_tokens_per_second=st.generation_tokens / max(time.monotonic() - st.started, 1e-9),
            steps=st.steps, step_seconds=st.step_seconds, first_tokens=st.first_tokens,
            phase_seconds=dict(st.phase_seconds), structured=self.engine.structured_stats(),
            graphs_pending=self.engine.graphs_left_for_idle, kernels=dict(self._kernels or {}))
