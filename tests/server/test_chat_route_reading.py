"""The chat route with `--reasoning-parser qwen3` over a scripted engine (the demo tokenizer, an
output given token by token): the message's `reasoning_content`, `content` and `tool_calls`, and
a stream whose deltas join to the same; a request's grammar set to start after `</think>`."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from compiled.demo import MOE_MODEL
from compiled.runtime.tokenizer import load_tokenizer
from compiled.server.app import Server, create_app
from compiled.server.chat_output import ChatOptions
from compiled.server.messages import ModelInfo, Progress

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
OUTPUT = '<think>need the weather</think>\n\nLooking.\n<tool_call>\n{"name": "weather", "arguments": {"city": "ab"}}' \
         '\n</tool_call>'


class _ScriptedEngine:
    """An engine client whose every request writes `OUTPUT`, one token a report."""

    alive = True

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.submitted, self.keys = tokens, [], 0

    def bind(self, loop) -> None:
        pass

    def new_key(self) -> int:
        self.keys += 1
        return self.keys

    def waiting(self) -> int:
        return 0

    def abort(self, key: int) -> None:
        pass

    def submit(self, requests, posted: float) -> asyncio.Queue:
        self.submitted += requests
        queue: asyncio.Queue = asyncio.Queue()
        for index in range(len(requests)):
            for j, token in enumerate(self.tokens):
                last = j == len(self.tokens) - 1
                queue.put_nowait((index, Progress([token], None, last, "stop" if last else None, None, None,
                                                  0 if j == 0 else None)))
        return queue


@pytest.fixture(scope="module")
def http():
    engine = _ScriptedEngine(load_tokenizer(MOE_MODEL).encode(OUTPUT))
    info = ModelInfo(MOE_MODEL, 512, 288, MOE_MODEL, False, ())
    with TestClient(create_app(Server(engine, info, "m", None, ChatOptions(reasoning_parser="qwen3")))) as client:
        client.engine = engine
        yield client


def _body(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER], **extra}


def test_reasoning_content_and_tool_calls_whole_and_streamed(http):
    choice = http.post("/v1/chat/completions", json=_body()).json()["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == "need the weather" and message["content"] == "\n\nLooking."
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "ab"}'}
    assert choice["finish_reason"] == "tool_calls"
    lines = http.post("/v1/chat/completions", json=_body(stream=True)).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "weather" and calls[0]["id"].startswith("call_")
    assert "".join(t["function"]["arguments"] for t in calls) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_grammar_starts_after_thinking_unless_thinking_is_off(http):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    http.post("/v1/chat/completions", json=_body(response_format=fmt))
    assert http.engine.submitted[-1].params.structured_outputs.after == "</think>"
    off = http.post("/v1/chat/completions", json=_body(response_format=fmt,
                                                       chat_template_kwargs={"enable_thinking": False}))
    assert http.engine.submitted[-1].params.structured_outputs.after is None
    assert "reasoning_content" not in off.json()["choices"][0]["message"]   # no reasoning read
