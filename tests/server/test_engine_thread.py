"""The handlers' side of the engine thread never waits for a step: while one runs, submitting,
aborting, counting and posting a call all return at once, and what they posted runs on the
engine's thread between steps, in order."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from types import SimpleNamespace

from compiled.server.engine_thread import EngineThread


class _HeldEngine:
    """An engine whose step runs until the test lets it end."""
    loras = None

    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(running=[], waiting=deque())
        self.stepping, self.release = threading.Event(), threading.Event()
        self.log: list[tuple[str, int]] = []

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting)

    def add(self, request) -> None:
        self.log.append(("add", request.id))
        self.scheduler.waiting.append(request)

    def abort(self, request_id: int) -> None:
        self.log.append(("abort", request_id))
        self.scheduler.waiting = deque(r for r in self.scheduler.waiting if r.id != request_id)

    def step(self) -> list:
        self.stepping.set()
        self.release.wait(30)
        return []

    def capture_pending_graphs(self, at_most: int | None = None) -> int:
        return 0


def _request(i: int):
    return SimpleNamespace(id=i, lora=None, output_token_ids=[], logprobs=None, prompt_token_ids=[1])


def test_handlers_never_wait_for_a_running_step():
    engine = _HeldEngine()
    thread = EngineThread(SimpleNamespace(engine=engine))
    thread.start()
    posted = {}

    def handlers() -> None:
        async def main() -> None:
            thread.submit([_request(1)])
            assert await asyncio.to_thread(engine.stepping.wait, 10), "the engine never stepped"
            # the step is running now (held): none of these may wait for it
            thread.submit([_request(2)])
            thread.abort(1)
            posted["counts"] = thread.counts()
            posted["call"] = thread.call(lambda: list(engine.log))
        asyncio.run(main())

    front = threading.Thread(target=handlers)
    front.start()
    front.join(10)
    try:
        assert not front.is_alive(), "a handler waited for the running step"
        assert not posted["call"].done(), "the call ran beside the step instead of after it"
    finally:
        engine.release.set()
    # after the step: the posts ran in order, before the next step
    assert posted["call"].result(10) == [("add", 1), ("add", 2), ("abort", 1)]
    assert posted["counts"] == (0, 1)
    engine.scheduler.waiting.clear()
    thread.stop()


class _EngineWithPendingGraphs(_HeldEngine):
    """Graph buckets left for later at start; captures are logged, steps return at once."""

    def __init__(self, pending: int) -> None:
        super().__init__()
        self.pending, self.idle = pending, threading.Event()
        self.release.set()

    def step(self) -> list:
        self.log.append(("step", len(self.scheduler.waiting)))
        self.scheduler.waiting.clear()
        return []

    def capture_pending_graphs(self, at_most: int | None = None) -> int:
        assert at_most == 1 and not self.has_work, "a capture must wait for the requests"
        done = min(self.pending, at_most)
        self.pending -= done
        self.log += [("capture", self.pending)] * done
        if not self.pending:
            self.idle.set()
        return done


def test_idle_engine_captures_the_buckets_left_for_later_one_at_a_time():
    engine = _EngineWithPendingGraphs(pending=3)
    thread = EngineThread(SimpleNamespace(engine=engine))
    thread.start()
    try:
        assert engine.idle.wait(10), "the idle engine left graph buckets uncaptured"
        thread.call(lambda: engine.scheduler.waiting.append(_request(1))).result(10)
        assert thread.call(lambda: list(engine.log)).result(10)[:3] == [("capture", 2), ("capture", 1),
                                                                       ("capture", 0)]
    finally:
        thread.stop()
    assert ("step", 1) in engine.log and engine.log.count(("capture", 0)) == 1
