"""The OpenAI-compatible HTTP API (FastAPI): `/v1/completions`, `/v1/chat/completions` (streamed
over server-sent events or not), `/v1/models`, `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`,
`/health`, `/metrics` (Prometheus text), and vLLM's `/tokenize`, `/detokenize` and `/version`.

A request's `model` names the base model (its folder name, or `--served-model-name`) or a loaded
adapter, as in vLLM. Prompts are tokenized, outputs detokenized and stop strings found here, beside
the engine's process (a stop string aborts its engine request, as vLLM's front end does); `n`
choices are `n` engine requests (seed + i each when seeded). A client that goes away aborts its
requests, which frees their KV at once."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from compiled.version import __version__
from compiled.errors import CompiledError
from compiled.server.engine_loop import FIRST_TOKEN_PHASES, Progress
from compiled.server.engine_process import EngineGone
from compiled.server.protocol import APIError, Sampling, bad, sampling
from compiled.server.serving import Server, choice_body, logprobs_body, with_prompt


def _sse(data) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _next_reports(queue: asyncio.Queue, done: set[int]) -> list[tuple[int, Progress]]:
    """The next reports of an HTTP request's engine requests: waits for one, then takes every one
    already queued with it, merged per request, so that a front end behind the engine handles
    (and streams) several steps' tokens as one event instead of one event each. Requests in
    `done` are skipped (the engine's reports past a stop string found here)."""
    batch = [await queue.get()]
    while not queue.empty():
        batch.append(queue.get_nowait())
    merged: dict[int, Progress] = {}
    for index, item in batch:
        if index is None:
            raise asyncio.CancelledError   # the client went away (`_watch_disconnect`)
        if index in done:
            continue
        if isinstance(item, Exception):
            raise APIError(500, f"the engine failed this request: {item}")
        merged[index] = merged[index].followed_by(item) if index in merged else item
    return list(merged.items())


async def _watch_disconnect(http: HTTPRequest, queue: asyncio.Queue) -> None:
    """Wake the handler with (None, None) when its client goes away (one task a request, rather
    than a timeout on every wait for a token)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait((None, None))


class RequireKey:
    """ASGI middleware: a /v1 request without `Authorization: Bearer <key>` is a 401 (as vLLM's
    --api-key; /health, /metrics and the rest stay open). Plain ASGI, so streamed responses and
    disconnects pass through untouched."""

    def __init__(self, app, key: str) -> None:
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                error = APIError(401, "this server needs an API key: send `Authorization: Bearer <key>`")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(server: Server, api_key: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_):
        server.engine.bind(asyncio.get_running_loop())
        yield

    app = FastAPI(title="compiled", lifespan=lifespan)
    if api_key:
        app.add_middleware(RequireKey, key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(EngineGone)
    async def _engine_gone(_, e: EngineGone):   # a call (metrics, adapters) to an engine that exited
        return JSONResponse(APIError(503, str(e)).body(), status_code=503)

    async def body_of(http: HTTPRequest) -> dict:
        try:
            body = await http.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        if not server.engine.alive:
            raise APIError(503, "the engine has stopped")
        return {}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest):
        """vLLM's: a completions `prompt` or a chat's `messages` as the ids the server would run."""
        body = await body_of(http)
        if "messages" in body:
            ids = server.chat_prompt(body)
        else:
            if isinstance(body.get("prompt"), list):
                raise bad("prompt", "expected a string")
            ids = server.prompts_of(body)[0]
        return {"count": len(ids), "max_model_len": server.info.max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest):
        body = await body_of(http)
        ids, vocab = body.get("tokens"), server.info.vocab_size
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
            raise bad("tokens", f"expected a list of token ids in [0, {vocab})")
        if server.tokenizer is None:
            raise bad("tokens", "the model has no tokenizer")
        return {"prompt": server.tokenizer.decode(ids, skip_special_tokens=False)}

    @app.get("/v1/models")
    async def models():
        data = [{"id": server.served_name, "object": "model", "created": server.created, "owned_by": "compiled",
                 "root": server.info.model_path, "parent": None,
                 "max_model_len": server.info.max_context}]
        data += [{"id": name, "object": "model", "created": server.created, "owned_by": "compiled", "root": name,
                  "parent": server.served_name} for name in server.loras]
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora(http: HTTPRequest):
        body = await body_of(http)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name:
            raise bad("lora_name", "expected a non-empty string")
        if not isinstance(path, str) or not path:
            raise bad("lora_path", "expected a folder path")
        if name in server.loras:
            raise APIError(409, f"lora_name: adapter {name!r} is already loaded", "lora_name")
        try:   # the engine reads the files beside its steps
            await server.engine.call("load_lora", name, path)
        except CompiledError as e:
            raise APIError(400, str(e), "lora_path") from None
        server.loras.append(name)
        return PlainTextResponse(f"adapter {name!r} loaded")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(http: HTTPRequest):
        body = await body_of(http)
        name = body.get("lora_name")
        if name not in server.loras:
            raise APIError(404, f"lora_name: no adapter {name!r} is loaded", "lora_name")
        try:
            await server.engine.call("unload_lora", name)
        except CompiledError as e:
            raise APIError(400, str(e), "lora_name") from None
        server.loras.remove(name)
        return PlainTextResponse(f"adapter {name!r} unloaded")

    @app.get("/metrics")
    async def metrics():
        m = await server.engine.call("metrics")
        lines = [
            "# TYPE compiled_requests_running gauge", f"compiled_requests_running {m['running']}",
            "# TYPE compiled_requests_waiting gauge", f"compiled_requests_waiting {m['waiting']}",
            "# HELP compiled_kv_cache_usage share of KV slots held by requests (cached prefixes excluded)",
            "# TYPE compiled_kv_cache_usage gauge", f"compiled_kv_cache_usage {m['kv_in_use']:.6f}",
            "# TYPE compiled_prefix_cache_tokens gauge", f"compiled_prefix_cache_tokens {m['prefix_cache_tokens']}",
            "# TYPE compiled_prefix_cache_hit_rate gauge",
            f"compiled_prefix_cache_hit_rate {m['prefix_cache_hit_rate']:.6f}",
            "# TYPE compiled_requests_finished_total counter",
            f"compiled_requests_finished_total {m['requests_finished']}",
            "# TYPE compiled_prompt_tokens_total counter", f"compiled_prompt_tokens_total {m['prompt_tokens']}",
            "# TYPE compiled_generation_tokens_total counter",
            f"compiled_generation_tokens_total {m['generation_tokens']}",
            "# TYPE compiled_generation_tokens_per_second gauge",
            f"compiled_generation_tokens_per_second {m['generation_tokens_per_second']:.3f}",
            "# HELP compiled_engine_step_seconds wall time of the engine's steps",
            "# TYPE compiled_engine_step_seconds summary",
            f"compiled_engine_step_seconds_sum {m['step_seconds']:.6f}",
            f"compiled_engine_step_seconds_count {m['steps']}",
        ]
        for phase, seconds in m["phase_seconds"].items():
            name = f"compiled_first_token_{phase}_seconds"
            lines += [f"# HELP {name} {FIRST_TOKEN_PHASES[phase]}", f"# TYPE {name} summary",
                      f"{name}_sum {seconds:.6f}", f"{name}_count {m['first_tokens']}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body = await body_of(http)
        return await _generate(http, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        body = await body_of(http)
        return await _generate(http, body, chat=True)

    async def _generate(http: HTTPRequest, body: dict, chat: bool):
        adapter = server.adapter_of(body)
        prompts = [server.chat_prompt(body)] if chat else server.prompts_of(body)
        context = server.info.max_context
        s = sampling(body, max(len(p) for p in prompts), context, chat)
        requests, queue = server.start(prompts, s, adapter)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        model = body.get("model") or server.served_name
        # echo: each choice's prompt text (requests run prompt by prompt, n choices each)
        echoed = [t for t in server.prompt_texts(body, prompts) for _ in s.params] if s.echo else None
        if s.stream:
            return StreamingResponse(_stream(http, rid, model, requests, queue, s, chat, echoed),
                                     media_type="text/event-stream")
        return await _complete(http, rid, model, requests, queue, s, chat, echoed)

    async def _complete(http, rid, model, requests, queue, s: Sampling, chat: bool, echoed: list[str] | None):
        texts = server.texts(requests)
        tokens, logprobs = [[] for _ in requests], [[] for _ in requests]
        prompt_logprobs: list = [None] * len(requests)
        cached: list[int | None] = [None] * len(requests)
        last: dict[int, Progress] = {}
        watch = asyncio.ensure_future(_watch_disconnect(http, queue))
        try:
            while len(last) < len(requests):
                for i, p in await _next_reports(queue, set(last)):
                    p = server.advance(requests[i], texts[i], p)
                    tokens[i] += p.token_ids
                    logprobs[i] += p.logprobs or []
                    prompt_logprobs[i] = prompt_logprobs[i] or p.prompt_logprobs
                    cached[i] = cached[i] if cached[i] is not None else p.cached_tokens
                    if p.finished:
                        last[i] = p
        finally:
            watch.cancel()
            for r in requests:
                server.engine.abort(r.id)   # a no-op for finished requests
        choices = [choice_body(server, i, last[i], texts[i].text, tokens[i], logprobs[i], s, chat)
                   for i in range(len(requests))]
        if echoed is not None:
            choices = [with_prompt(server, c, echoed[i], requests[i].prompt_token_ids, prompt_logprobs[i], s)
                       for i, c in enumerate(choices)]
        completion = 0 if s.prompt_only else sum(map(len, tokens))
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model, "choices": choices, "usage": server.usage(requests, len(s.params), completion, cached)}

    async def _stream(http, rid, model, requests, queue, s: Sampling, chat: bool,
                      echoed: list[str] | None) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        completion = 0
        done: set[int] = set()
        started: set[int] = set()   # choices that sent a chunk
        cached: list[int | None] = [None] * len(requests)
        sent_text = [0] * len(requests)
        texts = server.texts(requests)
        longest_stop = max((len(x) for x in (s.params[0].stop or [])), default=0)

        def chunk(choices: list, usage: dict | None = None) -> str:
            data = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
            if usage is not None:
                data["usage"] = usage
            return _sse(data)

        watch = asyncio.ensure_future(_watch_disconnect(http, queue))
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(requests))])
            while len(done) < len(requests):
                for i, p in await _next_reports(queue, done):
                    p = server.advance(requests[i], texts[i], p)
                    completion += 0 if s.prompt_only else len(p.token_ids)
                    cached[i] = cached[i] if cached[i] is not None else p.cached_tokens
                    text = texts[i].text
                    # text held back while it might still end in a stop string
                    upto = len(text) if p.finished else max(sent_text[i], len(text) - max(longest_stop - 1, 0))
                    delta, sent_text[i] = text[sent_text[i]:upto], max(sent_text[i], upto)
                    choice = {"index": i, "finish_reason": p.finish_reason if p.finished else None}
                    lp = None
                    if s.top_logprobs is not None and p.logprobs:
                        lp = logprobs_body(server, p.token_ids, p.logprobs, s, chat)
                    if chat:
                        choice.update(delta={"content": delta} if delta or not p.finished else {}, logprobs=lp)
                    else:
                        choice.update(text=delta, logprobs=lp)
                        if echoed is not None and i not in started:   # the prompt leads its first chunk
                            with_prompt(server, choice, echoed[i], requests[i].prompt_token_ids, p.prompt_logprobs, s)
                        started.add(i)
                    if p.finished:
                        done.add(i)
                        if p.stop_reason is not None:
                            choice["stop_reason"] = p.stop_reason
                    yield chunk([choice])
            if s.include_usage:
                yield chunk([], server.usage(requests, len(s.params), completion, cached))
            yield "data: [DONE]\n\n"
        finally:
            watch.cancel()
            for r in requests:
                server.engine.abort(r.id)   # a no-op for finished requests

    return app
