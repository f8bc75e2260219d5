"""`/v1/models` (the base model and every loaded adapter) and vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`."""

from __future__ import annotations

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import PlainTextResponse

from compiled.errors import CompiledError
from compiled.server.messages import LoadLora, UnloadLora
from compiled.server.protocol import APIError, bad
from compiled.server.routes.common import body_of, server_of

router = APIRouter()


@router.get("/v1/models", response_model=None)
async def models(http: HTTPRequest) -> dict:
    server = server_of(http)
    data = [{"id": server.served_name, "object": "model", "created": server.created, "owned_by": "compiled",
             "root": server.info.model_path, "parent": None,
             "max_model_len": server.info.max_context}]
    data += [{"id": name, "object": "model", "created": server.created, "owned_by": "compiled", "root": name,
              "parent": server.served_name} for name in server.loras]
    return {"object": "list", "data": data}


@router.post("/v1/load_lora_adapter")
async def load_lora(http: HTTPRequest) -> PlainTextResponse:
    server, body = server_of(http), await body_of(http)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name:
        raise bad("lora_name", "expected a non-empty string")
    if not isinstance(path, str) or not path:
        raise bad("lora_path", "expected a folder path")
    if name in server.loras:
        raise APIError(409, f"lora_name: adapter {name!r} is already loaded", "lora_name")
    try:   # the engine reads the files beside its steps
        await server.engine.call(LoadLora(name, path))
    except CompiledError as e:
        raise APIError(400, str(e), "lora_path") from None
    server.loras.append(name)
    return PlainTextResponse(f"adapter {name!r} loaded")


@router.post("/v1/unload_lora_adapter")
async def unload_lora(http: HTTPRequest) -> PlainTextResponse:
    server, body = server_of(http), await body_of(http)
    name = body.get("lora_name")
    if name not in server.loras:
        raise APIError(404, f"lora_name: no adapter {name!r} is loaded", "lora_name")
    try:
        await server.engine.call(UnloadLora(name))
    except CompiledError as e:
        raise APIError(400, str(e), "lora_name") from None
    server.loras.remove(name)
    return PlainTextResponse(f"adapter {name!r} unloaded")
