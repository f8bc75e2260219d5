"""The engine in a process of its own, and the front end's handle on it.

`EngineClient.start` spawns the process (`serve_engine`: it builds the LLM and runs its
`EngineLoop`) and waits until it serves. Two pipes join them: the front end posts requests,
aborts and calls down one; the engine's tokens and replies come back up the other, read by a
thread of the front end that hands them to the event loop, one wake-up a message. Neither side
ever waits for the other: a burst of HTTP requests is parsed, checked and detokenized beside the
engine's steps, not between them (as a thread of the same process, every step would queue for
the interpreter lock behind the handlers)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from compiled.server.engine_loop import EngineLoop, picklable
from compiled.server.messages import (
    Abort, Add, Call, Counts, Failures, Gone, ModelInfo, Ready, Reply, Reports, StartFailed, Stop, Submitted,
)

log = logging.getLogger(__name__)


class EngineGone(RuntimeError):
    """The engine's process exited."""


def serve_engine(make_llm: Callable[[], object], inbox: Connection, outbox: Connection) -> None:
    """The engine process: build the LLM, say what it serves, run its loop until told to stop."""
    # Ctrl-C at a terminal reaches the whole process group: the front end drains its requests,
    # then stops this process; it must not die under them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        llm = make_llm()
    except BaseException as e:
        outbox.send(StartFailed(picklable(e)))
        return
    loop = EngineLoop(llm, outbox.send)
    outbox.send(Ready(ModelInfo.of(llm)))
    threading.Thread(target=_receive, args=(inbox, loop), name="compiled-engine-inbox", daemon=True).start()
    try:
        loop.run()
    finally:
        llm.shutdown()


def _receive(inbox: Connection, loop: EngineLoop) -> None:
    while True:
        try:
            message = inbox.recv()
        except (EOFError, OSError):   # the front end exited without stopping us
            loop.post(Gone())
            return
        loop.post(message)


class EngineClient:
    """The front end's side: posts to the engine and routes what comes back to each request's
    asyncio queue. Every method but `start` and `stop` is called on the event loop's thread."""

    def __init__(self, make_llm: Callable[[], object]) -> None:
        self._make_llm = make_llm
        self._keys = itertools.count(1)
        self._routes: dict[int, tuple[asyncio.Queue, int]] = {}   # key -> (its submit's queue, index there)
        self._replies: dict[int, asyncio.Future] = {}
        self._posted = 0                 # requests posted
        self._counts = Counts()          # as the engine last reported them
        self._handlers = {Reports: self._on_reports, Failures: self._on_failures, Reply: self._on_reply}
        self.alive = False
        self.info: ModelInfo | None = None

    def start(self) -> ModelInfo:
        """Spawn the engine's process and wait until it serves; raises what failed its start."""
        ctx = multiprocessing.get_context("spawn")   # CUDA cannot be forked
        inbox, self._send_end = ctx.Pipe(duplex=False)
        self._recv_end, outbox = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=serve_engine, args=(self._make_llm, inbox, outbox),
                                   name="compiled-engine")
        self.process.start()
        inbox.close()
        outbox.close()
        try:
            started = self._recv_end.recv()
        except EOFError:
            self.process.join()
            raise EngineGone(f"the engine process exited with status {self.process.exitcode} while starting") \
                from None
        if isinstance(started, StartFailed):
            self.process.join()
            raise started.error
        self.alive, self.info = True, started.info
        return started.info

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start handing the engine's messages to `loop` (the handlers' event loop)."""
        self._loop = loop
        threading.Thread(target=self._read, name="compiled-engine-outbox", daemon=True).start()

    def stop(self, timeout: float = 60.0) -> None:
        """Let the engine finish what it was given, then end its process."""
        self.alive = False   # its pipe's end is expected now, not an error
        if self.process.is_alive():
            try:
                self._send_end.send(Stop())
            except OSError:
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                log.warning("the engine process did not stop within %.0f s: terminating it", timeout)
                self.process.terminate()
                self.process.join()
        self._send_end.close()

    # ---- called by the handlers ------------------------------------------------------------

    def new_key(self) -> int:
        return next(self._keys)

    def submit(self, requests: list[Submitted], posted: float) -> asyncio.Queue:
        """Post `requests`; the queue of their reports, each `(index in requests, Progress or the
        Exception that failed it)`. `posted`: when the handler took them (perf_counter)."""
        if not self.alive:
            raise EngineGone("the engine process has exited")
        queue: asyncio.Queue = asyncio.Queue()
        for i, r in enumerate(requests):
            self._routes[r.id] = (queue, i)
        self._post(Add(list(requests), posted))
        self._posted += len(requests)
        return queue

    def abort(self, key: int) -> None:
        """Stop request `key` (a no-op once it finished)."""
        if self._routes.pop(key, None) is not None and self.alive:
            self._post(Abort(key))

    async def call(self, command: Call) -> object:
        """Run `command` in the engine loop between two steps; the value it replies, or its error
        raised."""
        if not self.alive:
            raise EngineGone("the engine process has exited")
        command = dataclasses.replace(command, call_id=next(self._keys))
        future = self._loop.create_future()
        self._replies[command.call_id] = future
        self._post(command)
        return await future

    def waiting(self) -> int:
        """Requests queued in the engine, those posted but not yet received there included."""
        return self._counts.waiting + self._posted - self._counts.added

    def _post(self, message: object) -> None:
        try:
            self._send_end.send(message)
        except OSError:   # the engine's end is closed: its exit is being reported
            pass

    # ---- the engine's messages -------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = self._recv_end.recv()
            except (EOFError, OSError):
                message = None
            try:
                self._loop.call_soon_threadsafe(self._handle if message is not None else self._gone, message)
            except RuntimeError:   # the event loop has closed: the server is stopping
                return
            if message is None:
                return

    def _handle(self, message: object) -> None:
        handler = self._handlers.get(type(message))
        if handler is None:
            log.error("the engine sent an unknown message %r", message)
        else:
            handler(message)

    def _on_reports(self, message: Reports) -> None:
        self._counts = message.counts
        for key, progress in message.progress.items():
            route = self._routes.get(key)
            if route is None:   # aborted here meanwhile
                continue
            if progress.finished:
                del self._routes[key]
            queue, index = route
            queue.put_nowait((index, progress))

    def _on_failures(self, message: Failures) -> None:
        self._counts = message.counts
        for key, error in message.errors.items():
            route = self._routes.pop(key, None)
            if route is not None:   # else aborted here meanwhile
                queue, index = route
                queue.put_nowait((index, RuntimeError(error)))

    def _on_reply(self, message: Reply) -> None:
        future = self._replies.pop(message.call_id, None)
        if future is not None and not future.done():
            if message.error is not None:
                future.set_exception(message.error)
            else:
                future.set_result(message.value)

    def _gone(self, _=None) -> None:
        if not self.alive:
            return
        self.alive = False
        log.error("the engine process exited (status %s)", self.process.exitcode)
        error = EngineGone("the engine process exited")
        for queue, index in self._routes.values():
            queue.put_nowait((index, error))
        self._routes.clear()
        for future in self._replies.values():
            if not future.done():
                future.set_exception(error)
        self._replies.clear()
