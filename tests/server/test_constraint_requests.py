"""A request's constraint and tools as the server reads them: `response_format` and
`structured_outputs` become one `StructuredOutputs` (400s naming the field for invalid ones),
`tools` and `tool_choice` become the template's tools and, for required or a named function, a
grammar that accepts exactly the calls asked for; with a reasoning parser the grammar starts
after `</think>` unless thinking is off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string as accepts

from compiled.server.chat_output import ChatOptions
from compiled.server.constraints import request_constraint
from compiled.server.protocol import APIError
from compiled.server.routes.chat import CHAT
from compiled.server.tool_request import tool_request
from compiled.structured.spec import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}
NOW = {"type": "function", "function": {"name": "now"}}


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_response_format_and_structured_outputs_become_one_constraint():
    assert request_constraint({}) is None and request_constraint({"response_format": {"type": "text"}}) is None
    assert request_constraint({"response_format": {"type": "json_object"}}) == StructuredOutputs(json_object=True)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": False}}
    assert request_constraint({"response_format": fmt}) == StructuredOutputs(json=SCHEMA)
    for kind, value in (("json", SCHEMA), ("regex", "[a-z]+"), ("choice", ["a", "b"]), ("grammar", 'root ::= "x"')):
        spec = request_constraint({"structured_outputs": {kind: value}})
        assert spec.kind == kind and spec.after is None


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
    ({"structured_outputs": {"after": "</think>"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}}, "structured_outputs"),
])
def test_an_invalid_constraint_is_a_400_naming_its_field(body, param):
    with pytest.raises(APIError) as e:
        request_constraint(body)
    assert e.value.status == 400 and e.value.param == param and "\n" not in e.value.message


def test_required_and_named_tool_choices_are_grammars_of_exactly_those_calls():
    assert tool_request({}).choice == "none" and tool_request({"tools": [WEATHER]}).choice == "auto"
    assert tool_request({"tools": [WEATHER]}).constraint() is None
    assert tool_request({"tools": [WEATHER], "tool_choice": "none"}).parses is False
    weather, now = _call("weather", '{"city": "ab"}'), _call("now", "{}")
    required = tool_request({"tools": [WEATHER, NOW], "tool_choice": "required"}).constraint()
    grammar = xgrammar.Grammar.from_ebnf(required.grammar)
    assert accepts(grammar, weather) and accepts(grammar, now) and accepts(grammar, weather + "\n" + now)
    assert not accepts(grammar, "") and not accepts(grammar, _call("weather", '{"city": "toolong"}'))
    assert not accepts(grammar, _call("other", "{}")) and not accepts(grammar, weather.replace("city", "town"))
    single = tool_request({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    assert not accepts(xgrammar.Grammar.from_ebnf(single.constraint().grammar), weather + "\n" + weather)
    named = tool_request({"tools": [WEATHER, NOW], "tool_choice": {"type": "function", "function": {"name": "now"}}})
    grammar = xgrammar.Grammar.from_ebnf(named.constraint().grammar)
    assert named.function == "now" and accepts(grammar, now) and not accepts(grammar, weather)


@pytest.mark.parametrize("body, param", [
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nothing"}}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        tool_request(body)
    assert e.value.status == 400 and e.value.param == param and "\n" not in e.value.message


def _server(reasoning_parser: str | None):
    return SimpleNamespace(chat=ChatOptions(reasoning_parser=reasoning_parser), chat_prompt=lambda body, tools: [1])


def test_with_a_reasoning_parser_the_grammar_starts_after_thinking_unless_thinking_is_off():
    body = {"messages": [], "structured_outputs": {"regex": "[a-z]+"}}
    assert CHAT.prepare(_server(None), body).structured.after is None
    prepared = CHAT.prepare(_server("qwen3"), body)
    assert prepared.structured.after == "</think>" and prepared.output.reasoning is not None
    off = CHAT.prepare(_server("qwen3"), {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.structured.after is None and off.output.reasoning is None
    tools = CHAT.prepare(_server("qwen3"), {"messages": [], "tools": [WEATHER], "tool_choice": "required"})
    assert tools.structured.kind == "grammar" and tools.structured.after == "</think>" and tools.output.tools
    with pytest.raises(APIError) as e:
        CHAT.prepare(_server(None), {**body, "tools": [WEATHER], "tool_choice": "required"})
    assert e.value.param == "tool_choice"
