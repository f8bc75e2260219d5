"""vLLM's `/tokenize` (a completions `prompt` or a chat's `messages` as the ids the server would
run) and `/detokenize`."""

from __future__ import annotations

from fastapi import APIRouter, Request as HTTPRequest

from compiled.server.protocol import bad
from compiled.server.routes.common import body_of, server_of
from compiled.server.tool_request import tool_request

router = APIRouter()


@router.post("/tokenize", response_model=None)
async def tokenize(http: HTTPRequest) -> dict:
    server, body = server_of(http), await body_of(http)
    if "messages" in body:
        ids = server.chat_prompt(body, tool_request(body).tools)   # the prompt a chat request with them gets
    else:
        if isinstance(body.get("prompt"), list):
            raise bad("prompt", "expected a string")
        ids = server.prompts_of(body)[0]
    return {"count": len(ids), "max_model_len": server.info.max_context, "tokens": ids}


@router.post("/detokenize", response_model=None)
async def detokenize(http: HTTPRequest) -> dict:
    server, body = server_of(http), await body_of(http)
    ids, vocab = body.get("tokens"), server.info.vocab_size
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise bad("tokens", f"expected a list of token ids in [0, {vocab})")
    if server.tokenizer is None:
        raise bad("tokens", "the model has no tokenizer")
    return {"prompt": server.tokenizer.decode(ids, skip_special_tokens=False)}
