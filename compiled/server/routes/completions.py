"""`/v1/completions`: prompts as text or token ids (several prompts, `n` choices each), completions'
logprobs shape, and `echo` (each choice starts with its prompt and, with logprobs, its tokens')."""

from __future__ import annotations

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import StreamingResponse

from compiled.server.choices import ChoiceState
from compiled.server.protocol import Sampling
from compiled.server.routes.common import body_of
from compiled.server.constraints import request_constraint
from compiled.server.routes.generate import Prepared, Run, generate
from compiled.server.serving import Server

router = APIRouter()


class Completions:
    chat = False
    id_prefix = "cmpl"
    object = chunk_object = "text_completion"

    def prepare(self, server: Server, body: dict) -> Prepared:
        return Prepared(server.prompts_of(body), request_constraint(body))

    def logprobs(self, server: Server, tokens: list[int], logprobs: list, s: Sampling) -> dict:
        return _logprobs_body(server.logprobs_entry(tokens, logprobs, s.top_logprobs, chat=False))

    def opening(self, n: int) -> None:
        return None

    def whole(self, run: Run, choice: dict, c: ChoiceState, index: int) -> dict:
        choice["text"] = c.text
        if run.echoed is not None:
            _with_prompt(run.server, choice, run.echoed[index], c, run.s)
        return choice

    def streamed(self, run: Run, choice: dict, c: ChoiceState, text: str, logprobs: dict | None) -> None:
        choice.update(text=text, logprobs=logprobs)
        if run.echoed is not None and not c.started:   # the prompt leads its first chunk
            _with_prompt(run.server, choice, run.echoed[choice["index"]], c, run.s)


COMPLETIONS = Completions()


@router.post("/v1/completions", response_model=None)
async def completions(http: HTTPRequest) -> dict | StreamingResponse:
    return await generate(http, await body_of(http), COMPLETIONS)


def _with_prompt(server: Server, choice: dict, text: str, c: ChoiceState, s: Sampling) -> dict:
    """A choice (or a stream's first chunk of one) with its prompt in front, as `echo` asks (in
    place of what was generated when `prompt_only`): the prompt's text and, with logprobs, its
    tokens' (None for the first, which nothing predicts)."""
    generated = {"text": "", "logprobs": None} if s.prompt_only else choice
    choice["text"] = text + generated["text"]
    if s.top_logprobs is not None:
        ids = c.request.prompt_token_ids
        entries = [(server.token_text(ids[0]), None, None)]
        entries += server.logprobs_entry(ids[1:], c.prompt_logprobs[1:], s.top_logprobs, chat=False)
        logprobs = _logprobs_body(entries)
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            logprobs[key] += (generated["logprobs"] or {}).get(key, [])
        choice["logprobs"] = logprobs
    return choice


def _logprobs_body(entries: list) -> dict:
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [v for _, v, _ in entries],
            "top_logprobs": [top for _, _, top in entries], "text_offset": None}
