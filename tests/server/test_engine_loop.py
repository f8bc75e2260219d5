"""The engine's loop and the front end's handle on its process. Posting to the loop never waits
for a running step, and what was posted runs between steps, in order; reports carry each
request's new tokens and the engine's counts; the front end routes them to each request's queue,
counts what it posted but the engine has not seen as waiting, and fails every request when the
engine's process goes away (the server then answers 503s). A start that fails raises its error in the
front end."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from compiled import LLM
from compiled.errors import ConfigError, RequestError
from compiled.runtime.sampling_params import SamplingParams
from compiled.server.engine_loop import EngineLoop
from compiled.server.engine_process import EngineClient, EngineGone
from compiled.server.messages import (
    Abort, Add, Call, Counts, Failures, GetMetrics, Progress, Reply, Reports, Stop, Submitted,
)


class _Request(SimpleNamespace):
    pass


class _HeldEngine:
    """An engine whose step runs until the test lets it end, then gives each running request one
    token (id 7); a request finishes at its max_new_tokens."""
    loras = None

    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(running=[], waiting=deque())
        self.stepping, self.release = threading.Event(), threading.Event()
        self.log: list[tuple[str, int]] = []
        self._ids = iter(range(100, 10_000))

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def make_request(self, index, ids, params, lora, detokenize=True):
        if lora is not None:
            raise RequestError(f"prompt {index} asks for unknown adapter {lora!r}")
        return _Request(id=next(self._ids), prompt_token_ids=ids, params=params, lora=lora, output_token_ids=[],
                        logprobs=None, prompt_logprobs=None, num_cached_tokens=None, finish_reason=None,
                        stop_reason=None,
                        first_launched=None)

    def add(self, request) -> None:
        self.log.append(("add", request.id))
        self.scheduler.waiting.append(request)

    def abort(self, request_id: int) -> None:
        self.log.append(("abort", request_id))
        s = self.scheduler
        s.waiting = deque(r for r in s.waiting if r.id != request_id)
        s.running = [r for r in s.running if r.id != request_id]

    def step(self) -> list:
        self.stepping.set()
        self.release.wait(30)
        s = self.scheduler
        s.running += list(s.waiting)
        s.waiting.clear()
        finished = []
        for r in s.running:
            r.first_launched = r.first_launched or 0.0
            r.output_token_ids.append(7)
            if len(r.output_token_ids) >= r.params.max_new_tokens:
                r.finish_reason = "length"
                finished.append(r)
        s.running = [r for r in s.running if r.finish_reason is None]
        return finished

    def capture_pending_graphs(self, at_most: int | None = None) -> int:
        return 0


@dataclass
class _Log(Call):
    """A call answered with the engine's log (registered by `_loop`)."""


@dataclass
class _Unknown(Call):
    """A call the loop has no handler for."""


def _add(*items: Submitted) -> Add:
    return Add(list(items), 0.0)


def _item(key: int, max_new_tokens: int = 2, lora=None) -> Submitted:
    return Submitted(key, [1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens), lora)


def _items(sent: list) -> list[tuple]:
    """Every (key, Progress) and (key, error message) the loop sent, in order."""
    items = []
    for m in sent:
        if isinstance(m, Reports):
            items += m.progress.items()
        elif isinstance(m, Failures):
            items += m.errors.items()
    return items


def _loop(engine) -> tuple[EngineLoop, list, threading.Thread]:
    sent: list = []
    loop = EngineLoop(SimpleNamespace(engine=engine, unload_lora=None), sent.append)
    loop._handlers[_Log] = loop._answering(lambda m: list(engine.log))
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    return loop, sent, thread


def _reply(sent: list, call_id: int, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in list(sent):
            if isinstance(m, Reply) and m.call_id == call_id:
                return m
        time.sleep(0.01)
    raise AssertionError(f"no reply to call {call_id} within {timeout} s")


def test_posts_never_wait_for_a_running_step_and_run_in_order_after_it():
    engine = _HeldEngine()
    loop, sent, thread = _loop(engine)
    loop.post(_add(_item(1)))
    assert engine.stepping.wait(10), "the engine never stepped"
    # the step is running now (held): posting returns at once, and nothing runs beside the step
    loop.post(_add(_item(2)))
    loop.post(Abort(1))
    loop.post(_Log(call_id=50))
    assert not any(isinstance(m, Reply) for m in sent), "a call ran beside the step instead of after it"
    engine.release.set()
    reply = _reply(sent, 50)
    assert (reply.error, reply.value) == (None, [("add", 100), ("add", 101), ("abort", 100)])
    loop.post(Stop())
    thread.join(10)
    assert not thread.is_alive(), "stop did not end the loop once its requests finished"
    reports = _items(sent)
    # key 1 got its first token before the abort; key 2 ran to its max_new_tokens
    assert [r for r in reports if r[0] == 2] == [(2, Progress([7], None, False, None, None, None, 0)),
                                                (2, Progress([7], None, True, "length", None, None, None))]
    assert isinstance(sent[-1], Reports) and sent[-1].counts == Counts(0, 0, 2)


def test_a_request_the_engine_refuses_is_reported_as_an_error_naming_it():
    engine = _HeldEngine()
    engine.release.set()
    loop, sent, thread = _loop(engine)
    loop.post(_add(_item(1, lora="gone"), _item(2, max_new_tokens=1)))
    loop.post(_Unknown(call_id=9))
    loop.post(Stop())
    thread.join(10)
    items = _items(sent)
    assert (1, "prompt 0 asks for unknown adapter 'gone'") in items
    assert (2, Progress([7], None, True, "length", None, None, 0)) in items
    error = next(m for m in sent if isinstance(m, Reply)).error
    assert isinstance(error, KeyError)


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
    loop, sent, thread = _loop(engine)
    try:
        assert engine.idle.wait(10), "the idle engine left graph buckets uncaptured"
        loop.post(_add(_item(1)))
        loop.post(_Log(call_id=1))
        assert _reply(sent, 1).value[:3] == [("capture", 2), ("capture", 1), ("capture", 0)]
    finally:
        loop.post(Stop())
        thread.join(10)
    assert ("step", 1) in engine.log and engine.log.count(("capture", 0)) == 1


def _client() -> tuple[EngineClient, list]:
    client = EngineClient(lambda: None)
    posted: list = []
    client._post = posted.append
    client.alive, client.process = True, SimpleNamespace(exitcode=-9)
    return client, posted


def test_the_client_routes_reports_to_each_request_and_counts_what_waits():
    async def main():
        client, posted = _client()
        client._loop = asyncio.get_running_loop()
        a = [SimpleNamespace(id=client.new_key(), prompt_token_ids=[1], params=None, lora=None) for _ in range(2)]
        queue = client.submit(a, 0.0)
        assert isinstance(posted[-1], Add) and [r.id for r in posted[-1].requests] == [r.id for r in a]
        assert client.waiting() == 2            # posted, not yet seen by the engine
        client._handle(Reports({a[0].id: Progress([5, 6], None, False, None, None, None, 0)}, Counts(1, 1, 2)))
        assert client.waiting() == 1
        client.abort(a[1].id)
        assert posted[-1] == Abort(a[1].id)
        client._handle(Reports({a[1].id: Progress([9], None, True, "length", None, None, 0),
                                a[0].id: Progress([7], None, True, "stop", 7, None, None)}, Counts(0, 0, 2)))
        got = [queue.get_nowait() for _ in range(queue.qsize())]
        assert got == [(0, Progress([5, 6], None, False, cached_tokens=0)), (0, Progress([7], None, True, "stop", 7))]
        assert not client._routes
        b = client.submit([SimpleNamespace(id=client.new_key(), prompt_token_ids=[1], params=None, lora=None)], 0.0)
        call = asyncio.ensure_future(client.call(GetMetrics()))
        await asyncio.sleep(0)
        client._gone()
        index, error = b.get_nowait()
        assert index == 0 and isinstance(error, EngineGone)
        with pytest.raises(EngineGone):
            await call
        with pytest.raises(EngineGone):
            client.submit([], 0.0)
    asyncio.run(main())


def test_a_failed_start_raises_its_error_in_the_front_end():
    client = EngineClient(functools.partial(LLM, "/nonexistent/model-folder"))
    with pytest.raises(ConfigError, match="nonexistent"):
        client.start()
    assert not client.process.is_alive()


def test_the_engine_process_exits_when_the_front_end_goes_away():
    client = EngineClient(functools.partial(LLM, None, device="cpu"))
    info = client.start()
    assert info.max_context > 0 and info.vocab_size > 0
    client._send_end.close()   # as when the front end's process dies: the engine reads end of file
    client.process.join(60)
    assert not client.process.is_alive(), "the engine process outlived its front end"
    assert client.process.exitcode == 0


def test_a_server_whose_engine_exited_answers_503s():
    from fastapi.testclient import TestClient

    from compiled.server.app import Server, create_app
    from compiled.server.engine_process import ModelInfo
    client, _ = _client()
    client.bind = lambda loop: setattr(client, "_loop", loop)
    client._gone()
    info = ModelInfo("/models/m", 512, 100, None, False, ())
    with TestClient(create_app(Server(client, info, "m", None))) as http:
        for method, path, body in (("get", "/health", None), ("get", "/metrics", None),
                                   ("post", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})):
            r = getattr(http, method)(path, **({"json": body} if body else {}))
            assert r.status_code == 503 and "engine" in r.json()["error"]["message"], (path, r.text)


class _FailingOnceEngine(_HeldEngine):
    """Its first step raises (as a step rolled back after an error); later steps work."""

    def __init__(self) -> None:
        super().__init__()
        self.release.set()
        self.failed = False

    def step(self) -> list:
        if not self.failed:
            self.failed = True
            raise RuntimeError("CUDA error: an illegal memory access")
        return super().step()


def test_a_failed_step_fails_its_requests_and_the_loop_serves_on():
    engine = _FailingOnceEngine()
    loop, sent, thread = _loop(engine)
    loop.post(_add(_item(1)))
    loop.post(_Log(call_id=1))
    _reply(sent, 1)
    loop.post(_add(_item(2, max_new_tokens=1)))
    loop.post(Stop())
    thread.join(10)
    assert not thread.is_alive()
    items = _items(sent)
    assert (1, "RuntimeError: CUDA error: an illegal memory access") in items
    assert (2, Progress([7], None, True, "length", None, None, 0)) in items
    assert ("abort", 100) in engine.log   # the failed request left the engine
