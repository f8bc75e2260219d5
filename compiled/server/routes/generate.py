"""A completion's run, the same for `/v1/completions` and `/v1/chat/completions`: the request's
checks, its engine requests (`n` choices a prompt), and the response built from the choices'
state (`choices.py`), whole or streamed as server-sent events. What differs between the two APIs
(the prompt, the bodies' shapes) is a `Format` (`completions.py`, `chat.py`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from compiled.server.chat_output import ChatOutput, ChatStream
from compiled.server.choices import ChoiceState, Generation
from compiled.server.messages import Progress, Submitted
from compiled.server.protocol import Sampling, known_fields, sampling
from compiled.server.routes.common import server_of
from compiled.server.serving import Server
from compiled.structured.spec import StructuredOutputs


@dataclass
class Prepared:
    """What a request's body makes for the engine and for reading its output: its prompts (token
    ids), what the output must match, and how a chat's output is read."""
    prompts: list[list[int]]
    structured: StructuredOutputs | None = None
    output: ChatOutput | None = None


class Format(Protocol):
    """What one API makes of a completion's prompt and choices."""
    chat: bool
    id_prefix: str       # of the response's id
    object: str          # the response's `object`
    chunk_object: str    # a streamed chunk's

    def prepare(self, server: Server, body: dict) -> Prepared: ...

    def logprobs(self, server: Server, tokens: list[int], logprobs: list, s: Sampling) -> dict: ...

    def opening(self, n: int) -> list[dict] | None:
        """The choices of a stream's first chunk, sent before any token (None: no such chunk)."""

    def whole(self, run: Run, choice: dict, c: ChoiceState, index: int) -> dict:
        """`choice` (index, finish and logprobs set) with the choice's output, for a whole response."""

    def streamed(self, run: Run, choice: dict, c: ChoiceState, text: str, logprobs: dict | None) -> None:
        """`choice` of a streamed chunk with the output's new `text` and its tokens' `logprobs`."""


@dataclass
class Run:
    """One completion request: its sampling, its engine requests, and its response's header."""
    server: Server
    fmt: Format
    s: Sampling
    requests: list[Submitted]
    queue: asyncio.Queue
    model: str
    echoed: list[str] | None     # each choice's prompt text, with `echo`
    output: ChatOutput | None = None   # a chat's: how its choices are read
    streams: dict[int, ChatStream] = field(default_factory=dict)   # a streamed chat's, by choice
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{self.fmt.id_prefix}-{uuid.uuid4().hex}"

    def generation(self, http: HTTPRequest) -> Generation:
        return Generation(http, self.server.engine, self.requests, self.queue, self.server.tokenizer)

    def usage(self, g: Generation) -> dict:
        completion = 0 if self.s.prompt_only else sum(len(c.tokens) for c in g.choices)
        return self.server.usage(self.requests, len(self.s.params), completion, [c.cached for c in g.choices])

    def logprobs(self, tokens: list[int], logprobs: list | None) -> dict | None:
        if self.s.top_logprobs is None or not logprobs:
            return None
        return self.fmt.logprobs(self.server, tokens, logprobs, self.s)


async def generate(http: HTTPRequest, body: dict, fmt: Format) -> dict | StreamingResponse:
    """The response to a completion request: a JSON body, or a stream of events."""
    server = server_of(http)
    known_fields(body, fmt.chat)
    adapter = server.adapter_of(body)
    prepared = fmt.prepare(server, body)
    prompts = prepared.prompts
    s = sampling(body, max(len(p) for p in prompts), server.info.max_context, fmt.chat, prepared.structured)
    requests, queue = server.start(prompts, s, adapter)
    model = body.get("model") or server.served_name
    # echo: each choice's prompt text (requests run prompt by prompt, n choices each)
    echoed = [t for t in server.prompt_texts(body, prompts) for _ in s.params] if s.echo else None
    run = Run(server, fmt, s, requests, queue, model, echoed, prepared.output)
    if s.stream:
        return StreamingResponse(_stream(http, run), media_type="text/event-stream")
    return await _whole(http, run)


async def _whole(http: HTTPRequest, run: Run) -> dict:
    g = run.generation(http)
    try:
        while not g.finished:
            await g.next()
    finally:
        g.close()
    choices = []
    for i, c in enumerate(g.choices):
        lp = run.fmt.logprobs(run.server, c.tokens, c.logprobs, run.s) if run.s.top_logprobs is not None else None
        choice = {"index": i, "finish_reason": c.last.finish_reason, "stop_reason": c.last.stop_reason,
                  "logprobs": lp}
        choices.append(run.fmt.whole(run, choice, c, i))
    return {"id": run.id, "object": run.fmt.object, "created": run.created, "model": run.model,
            "choices": choices, "usage": run.usage(g)}


async def _stream(http: HTTPRequest, run: Run) -> AsyncIterator[str]:
    def chunk(choices: list, usage: dict | None = None) -> str:
        data = {"id": run.id, "object": run.fmt.chunk_object, "created": run.created, "model": run.model,
                "choices": choices}
        if usage is not None:
            data["usage"] = usage
        return f"data: {json.dumps(data)}\n\n"

    g = run.generation(http)
    try:
        opening = run.fmt.opening(len(run.requests))
        if opening is not None:
            yield chunk(opening)
        while not g.finished:
            for i, p in await g.next():
                yield chunk([_streamed_choice(run, g.choices[i], i, p)])
        if run.s.include_usage:
            yield chunk([], run.usage(g))
        yield "data: [DONE]\n\n"
    finally:
        g.close()


def _streamed_choice(run: Run, c: ChoiceState, index: int, p: Progress) -> dict:
    """A stream's chunk of choice `c` for its report `p` (folded in already)."""
    choice = {"index": index, "finish_reason": p.finish_reason if p.finished else None}
    run.fmt.streamed(run, choice, c, c.unsent_text(), run.logprobs(p.token_ids, p.logprobs))
    c.started = True
    if p.finished and p.stop_reason is not None:
        choice["stop_reason"] = p.stop_reason
    return choice
