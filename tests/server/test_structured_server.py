"""A real `compiled serve` on the demo MoE model (CPU) under constraints, driven by the `openai`
client: `response_format` and vLLM's `structured_outputs` give output that validates (jsonschema
for JSON) and ends with "stop", streamed or not, mixed with unconstrained requests in one batch
and under an adapter; Qwen3 tool calls (`tool_choice` required, named, none; streamed deltas; a
turn carrying tool results); bad constraints and tools are 400s while the server keeps serving."""

from __future__ import annotations

import json
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.server.test_server import client, start_server

MODEL = "qwen3-moe"
CHAT = [{"role": "user", "content": "copy hi:"}]
# Nested objects, an enum, a boolean, a bounded array, required members, no other members; strings
# bounded so that a model that knows nothing of JSON still ends.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "inner": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["n"], "additionalProperties": False},
    },
    "required": ["name", "kind", "ok", "tags", "inner"],
    "additionalProperties": False,
}
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}},
         "required": ["ok", "kind"], "additionalProperties": False}
REGEX = r"[a-z]{2,5}-\d{2}"
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--lora", "upper")
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_validates_and_streams_to_the_same_text(server):
    c = client(server)
    out = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, temperature=0,
                                    response_format=_schema_format(SCHEMA))
    text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert out.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, temperature=0, stream=True,
                                       response_format=_schema_format(SCHEMA))
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    assert "".join(ch.delta.content or "" for ch in chunks) == text and chunks[-1].finish_reason == "stop"


def test_json_object_choice_and_regex_validate(server):
    c = client(server)
    # A prompt the demo model answers with a short object under the grammar.
    out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 'copy {"kind":"dog"}:'}],
                                    max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    assert out.choices[0].finish_reason == "stop"
    out = c.completions.create(model=MODEL, prompt="copy hi:", max_tokens=20, temperature=0,
                               extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].text in ("yes", "no") and out.choices[0].finish_reason == "stop"
    out = c.completions.create(model=MODEL, prompt="copy hi:", max_tokens=20, temperature=0,
                               extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, out.choices[0].text) and out.choices[0].finish_reason == "stop"


def _request(i: int) -> tuple[str, dict]:
    """The i-th of 12 mixed requests: (kind, completions body)."""
    prompts = ["copy hi:", "copy Bird wax:", "COPY jam:", "count 7:"]
    body = {"model": MODEL, "prompt": prompts[i % 4], "max_tokens": 40, "temperature": 0}
    kind = ["plain", "choice", "regex", "json"][i % 4] if i < 8 else ["plain", "json"][i % 2]
    if kind == "choice":
        body["structured_outputs"] = {"choice": ["red", "green", "blue"]}
    elif kind == "regex":
        body["structured_outputs"] = {"regex": REGEX}
    elif kind == "json":
        body["response_format"] = _schema_format(SMALL if i % 3 else SCHEMA)
        body["max_tokens"] = 120
    return kind, body


def _check_constrained(kind: str, body: dict, choice: dict) -> None:
    assert choice["finish_reason"] == "stop", (kind, choice)
    if kind == "choice":
        assert choice["text"] in body["structured_outputs"]["choice"]
    elif kind == "regex":
        assert re.fullmatch(REGEX, choice["text"])
    else:
        jsonschema.validate(json.loads(choice["text"]), body["response_format"]["json_schema"]["schema"])


def test_twelve_concurrent_requests_mixing_schemas_with_plain_rows(server):
    requests = [_request(i) for i in range(12)]

    def send(body: dict) -> dict:
        response = httpx.post(server + "/v1/completions", json=body, timeout=600)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    with ThreadPoolExecutor(12) as pool:
        together = list(pool.map(send, [body for _, body in requests]))
    for (kind, body), choice in zip(requests, together):
        if kind == "plain":
            assert choice == send(body), body   # the same as the request sent alone
        else:
            _check_constrained(kind, body, choice)


def test_an_adapter_chosen_by_model_runs_under_a_choice(server):
    c = client(server)
    outs = {m: c.completions.create(model=m, prompt="copy hi:", max_tokens=10, temperature=0,
                                    extra_body={"structured_outputs": {"choice": [" hi", " HI"]}}).choices[0]
            for m in (MODEL, "upper")}
    # the base model copies, the `upper` adapter answers in uppercase: each picks its own choice
    assert outs[MODEL].text == " hi" and outs["upper"].text == " HI"
    assert all(o.finish_reason == "stop" for o in outs.values())


def _one_call(out, name: str) -> dict:
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    return json.loads(call.function.arguments)


def test_tool_choice_required_named_and_none(server):
    c = client(server)
    out = c.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, max_tokens=150, temperature=0)
    jsonschema.validate(_one_call(out, "weather"), WEATHER["function"]["parameters"])
    named = {"type": "function", "function": {"name": "now"}}
    out = c.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER, NOW], tool_choice=named,
                                    max_tokens=80, temperature=0)
    assert _one_call(out, "now") == {}
    none = c.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice="none",
                                     max_tokens=12, temperature=0).choices[0]
    auto = c.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], max_tokens=12,
                                     temperature=0).choices[0]
    # the demo model writes no call of its own: both are text, unconstrained
    assert none.message.tool_calls is None and none.finish_reason != "tool_calls"
    assert auto.message.content == none.message.content and auto.message.tool_calls is None


def test_a_streamed_tool_call_assembles_to_the_whole_one(server):
    c = client(server)
    args = dict(model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                max_tokens=150, temperature=0)
    whole = c.chat.completions.create(**args).choices[0].message.tool_calls[0]
    chunks = [ch.choices[0] for ch in c.chat.completions.create(**args, stream=True) if ch.choices]
    deltas = [d for ch in chunks for d in ch.delta.tool_calls or []]
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "weather" and all(d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 2   # the arguments came in pieces
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert chunks[-1].finish_reason == "tool_calls" and not any(ch.delta.content for ch in chunks)


def test_a_turn_carrying_tool_results(server):
    messages = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "ab"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ids = httpx.post(server + "/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()["tokens"]
    text = httpx.post(server + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "ab"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and '"name": "weather"' in text.split("<|user|>")[0]
    out = client(server).chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8,
                                                 temperature=0)
    assert out.usage.prompt_tokens == len(ids) and out.choices[0].message.role == "assistant"


BAD = [
    ({"response_format": _schema_format({"type": "wat"})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
]


def test_bad_constraints_and_tools_are_400s_while_the_server_keeps_serving(server):
    c = client(server)
    alone = c.completions.create(model=MODEL, prompt="count 7:", max_tokens=24, temperature=0).choices[0].text
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(lambda: c.completions.create(model=MODEL, prompt="count 7:", max_tokens=24,
                                                           temperature=0).choices[0].text)
        for extra, param in BAD:
            response = httpx.post(server + "/v1/chat/completions", timeout=60,
                                  json={"model": MODEL, "messages": CHAT, "max_tokens": 4, **extra})
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == param, (extra, error)
            assert param in error["message"] and "\n" not in error["message"]
        assert running.result() == alone
    with pytest.raises(openai.BadRequestError, match="structured_outputs"):
        c.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"structured_outputs": {"json": 5}})
    out = c.completions.create(model=MODEL, prompt="copy hi:", max_tokens=20, temperature=0,
                               extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].text in ("yes", "no")


def test_metrics_report_grammar_compiles_and_mask_times(server):
    client(server).completions.create(model=MODEL, prompt="copy hi:", max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"regex": REGEX}})
    text = httpx.get(server + "/metrics").text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert int(values["compiled_grammar_compiles_total"]) >= 1
    assert int(values["compiled_grammar_mask_steps_total"]) >= 1
    assert float(values['compiled_grammar_compile_seconds{quantile="0.99"}']) > 0
    assert float(values['compiled_grammar_mask_seconds{quantile="0.5"}']) > 0


def test_chat_template_kwargs_reach_the_template(server):
    count = [httpx.post(server + "/tokenize", json={"messages": CHAT, **extra}).json()["count"]
             for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}})]
    ids = httpx.post(server + "/tokenize", json={"prompt": "<think>\n\n</think>\n\n"}).json()["tokens"]
    assert count[1] == count[0] + len(ids)
