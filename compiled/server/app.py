"""The OpenAI-compatible HTTP API (FastAPI): `/v1/completions`, `/v1/chat/completions` (streamed
over server-sent events or not), `/v1/models`, `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`,
`/health`, `/metrics` (Prometheus text), and vLLM's `/tokenize`, `/detokenize` and `/version`
(the routes in `routes/`, one module a concern; the app's state is a `Server`).

A request's `model` names the base model (its folder name, or `--served-model-name`) or a loaded
adapter, as in vLLM. Prompts are tokenized, outputs detokenized and stop strings found here, beside
the engine's process (a stop string aborts its engine request, as vLLM's front end does); `n`
choices are `n` engine requests (seed + i each when seeded). A client that goes away aborts its
requests, which frees their KV at once."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from compiled.server.auth import RequireKey
from compiled.server.engine_process import EngineGone
from compiled.server.protocol import APIError
from compiled.server.routes import chat, completions, metrics, models, tokenize
from compiled.server.serving import Server

__all__ = ["RequireKey", "Server", "create_app"]


def create_app(server: Server, api_key: str | None = None) -> FastAPI:
    """The app serving `server`'s engine; with `api_key`, /v1 requests must bear it."""
    @contextlib.asynccontextmanager
    async def lifespan(_):
        server.engine.bind(asyncio.get_running_loop())
        yield

    app = FastAPI(title="compiled", lifespan=lifespan)
    app.state.server = server
    if api_key:
        app.add_middleware(RequireKey, key=api_key)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(EngineGone, _engine_gone)
    for routes in (metrics, tokenize, models, completions, chat):
        app.include_router(routes.router)
    return app


async def _api_error(_, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _engine_gone(_, e: EngineGone) -> JSONResponse:   # a call (metrics, adapters) to an engine that exited
    return JSONResponse(APIError(503, str(e)).body(), status_code=503)
