"""With an API key, /v1 requests without `Authorization: Bearer <key>` are 401s in OpenAI's error
shape; /health and the other routes stay open."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from compiled.server.app import create_app


def _app(key):
    server = SimpleNamespace(engine=SimpleNamespace(bind=lambda loop: None, alive=True), served_name="demo",
                             info=SimpleNamespace(model_path="demo", max_context=64), loras=[], created=0)
    return create_app(server, key)


def test_v1_needs_the_key_health_does_not():
    with TestClient(_app("s3cret")) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).json()["data"][0]["id"] == "demo"
        assert c.get("/health").status_code == 200


def test_no_key_no_check():
    with TestClient(_app(None)) as c:
        assert c.get("/v1/models").status_code == 200
