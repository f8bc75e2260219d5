"""`/v1/chat/completions`: the prompt from the chat's messages (and tools) through the model's
chat template (`Server.chat_prompt`), choices as assistant messages (reasoning and tool calls
read by `chat_output.py`), chat's logprobs shape, and a stream that opens with each choice's role."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import StreamingResponse

from compiled.server.choices import ChoiceState
from compiled.server.constraints import request_constraint
from compiled.server.protocol import Sampling, bad
from compiled.server.routes.common import body_of
from compiled.server.routes.generate import Prepared, Run, generate
from compiled.server.serving import Server
from compiled.server.tool_request import tool_request

router = APIRouter()


class Chat:
    chat = True
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def prepare(self, server: Server, body: dict) -> Prepared:
        """The prompt (with the request's tools), the constraint (`response_format`,
        `structured_outputs`, or the tool-call grammar of `tool_choice` required or named; after
        the reasoning, with a reasoning parser) and how the output is read."""
        tools = tool_request(body)
        structured, tool_grammar = request_constraint(body), tools.constraint()
        if structured is not None and tool_grammar is not None:
            raise bad("tool_choice", f"{tools.function or tools.choice} is a grammar of its own: it cannot be "
                      "combined with response_format or structured_outputs")
        prompts = [server.chat_prompt(body, tools.tools)]
        thinking = (body.get("chat_template_kwargs") or {}).get("enable_thinking") is not False
        output = server.chat.output(tools.parses, thinking)
        structured = structured or tool_grammar
        if structured is not None and output.reasoning is not None:
            structured = dataclasses.replace(structured, after=output.reasoning.end)
        return Prepared(prompts, structured, output)

    def logprobs(self, server: Server, tokens: list[int], logprobs: list, s: Sampling) -> dict:
        return {"content": server.logprobs_entry(tokens, logprobs, s.top_logprobs, chat=True)}

    def opening(self, n: int) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)]

    def whole(self, run: Run, choice: dict, c: ChoiceState, index: int) -> dict:
        choice["message"], called = run.output.message(c.text)
        if called and choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"
        return choice

    def streamed(self, run: Run, choice: dict, c: ChoiceState, text: str, logprobs: dict | None) -> None:
        if not run.output.reads:
            choice.update(delta={"content": text} if text or not c.finished else {}, logprobs=logprobs)
            return
        stream = run.streams.setdefault(choice["index"], run.output.stream())
        delta = stream.feed(text, last=c.finished)
        if c.finished and stream.called and choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"
        choice.update(delta=delta if delta or c.finished else {"content": ""}, logprobs=logprobs)


CHAT = Chat()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(http: HTTPRequest) -> dict | StreamingResponse:
    return await generate(http, await body_of(http), CHAT)
