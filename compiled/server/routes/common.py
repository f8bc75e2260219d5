"""What every route reads from its request: the app's `Server` and the JSON body."""

from __future__ import annotations

import json

from fastapi import Request as HTTPRequest

from compiled.server.protocol import APIError
from compiled.server.serving import Server


def server_of(http: HTTPRequest) -> Server:
    return http.app.state.server


async def body_of(http: HTTPRequest) -> dict:
    try:
        body = await http.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body
