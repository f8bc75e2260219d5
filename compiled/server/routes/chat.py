"""`/v1/chat/completions`: the prompt from the chat's messages through the model's chat template
(`Server.chat_prompt`), choices as assistant messages, chat's logprobs shape, and a stream that
opens with each choice's role."""

from __future__ import annotations

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import StreamingResponse

from compiled.server.choices import ChoiceState
from compiled.server.protocol import Sampling
from compiled.server.routes.common import body_of
from compiled.server.routes.generate import Run, generate
from compiled.server.serving import Server

router = APIRouter()


class Chat:
    chat = True
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def prompts(self, server: Server, body: dict) -> list[list[int]]:
        return [server.chat_prompt(body)]

    def logprobs(self, server: Server, tokens: list[int], logprobs: list, s: Sampling) -> dict:
        return {"content": server.logprobs_entry(tokens, logprobs, s.top_logprobs, chat=True)}

    def opening(self, n: int) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)]

    def whole(self, run: Run, choice: dict, c: ChoiceState, index: int) -> dict:
        choice["message"] = {"role": "assistant", "content": c.text}
        return choice

    def streamed(self, run: Run, choice: dict, c: ChoiceState, text: str, logprobs: dict | None) -> None:
        choice.update(delta={"content": text} if text or not c.finished else {}, logprobs=logprobs)


CHAT = Chat()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(http: HTTPRequest) -> dict | StreamingResponse:
    return await generate(http, await body_of(http), CHAT)
