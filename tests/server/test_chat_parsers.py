"""The chat output's parsers: Qwen3 tool calls read whole and streamed (tags split anywhere across
deltas, held back until known; the deltas assemble to the whole reading), reasoning split off at
`</think>`, and both together as a chat message and its stream."""

from __future__ import annotations

import json
import random

import pytest

from compiled.server.chat_output import ChatOptions
from compiled.server.parsers.reasoning import ReasoningStream, split_reasoning
from compiled.server.parsers.tool_calls import ToolCallStream, parse

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Pa\\"ris}", "days": [1, {"x": 2}]}}\n</tool_call>'
TEXTS = [
    "plain text, no call  \n",
    "Let me look.\n\n" + CALL,
    CALL + "\n" + CALL.replace("weather", "now") + "  \n",
    '<tool_call>\n{"name": "a", "arguments": {"k": 1}}',                   # cut before its end tag
    "a < b and <tool",                                                     # a tag's start, never finished
    '<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call> after',   # arguments as JSON text
    '<tool_call>\n{"name": "b", "arguments": {"q": "<tool_call>x"}}\n</tool_call>',
]


def _stream(text: str, seed: int) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    """`text` streamed in random pieces: (content, [(name, arguments)], every delta)."""
    rng, stream, content, deltas = random.Random(seed), ToolCallStream(), "", []
    i = 0
    while i < len(text):
        j = i + rng.randint(1, 5)
        piece, new = stream.feed(text[i:j])
        content, deltas, i = content + piece, deltas + new, j
    piece, new = stream.finish()
    content, deltas = content + piece, deltas + new
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function" and d["id"].startswith("call_")
            calls[d["index"]] = [d["function"]["name"], ""]
        calls[d["index"]][1] += d["function"]["arguments"]
    return content or None, [tuple(calls[i]) for i in sorted(calls)], deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_tool_calls_assemble_to_the_whole_reading(text):
    content, calls = parse(text)
    whole = (content, [(c.name, c.arguments) for c in calls])
    for seed in range(20):
        assert _stream(text, seed)[:2] == whole


def test_a_call_is_read_with_its_arguments_as_written():
    content, calls = parse("Let me look.\n\n" + CALL)
    assert content == "Let me look." and [c.name for c in calls] == ["weather"]
    assert json.loads(calls[0].arguments) == {"city": 'Pa"ris}', "days": [1, {"x": 2}]}
    body = calls[0].body()
    assert body["type"] == "function" and body["id"].startswith("call_")
    assert parse(TEXTS[2])[0] is None and [c.name for c in parse(TEXTS[2])[1]] == ["weather", "now"]


def test_a_block_that_is_no_call_leaves_the_text_as_it_is():
    text = "<tool_call>\nnot json\n</tool_call>"
    assert parse(text) == (text, [])
    assert parse('<tool_call>{"arguments": {}}</tool_call>')[1] == []   # no name


def test_a_tag_split_across_deltas_is_held_back_then_read():
    stream = ToolCallStream()
    assert stream.feed("Sure <tool") == ("Sure", [])    # the space may precede a call: held too
    assert stream.feed("_ca") == ("", [])
    text, deltas = stream.feed('ll>\n{"name": "f", "argu')
    assert text == "" and [d["function"] for d in deltas] == [{"name": "f", "arguments": ""}]
    text, deltas = stream.feed('ments": {"a": 1')
    assert deltas == [{"index": 0, "function": {"arguments": '{"a": 1'}}]
    text, deltas = stream.feed("}}\n</tool_")
    assert deltas == [{"index": 0, "function": {"arguments": "}"}}]
    assert stream.feed("call>") == ("", []) and stream.finish() == ("", [])
    # a `<` that begins no tag is text once that is known
    stream = ToolCallStream()
    assert stream.feed("a <") == ("a", []) and stream.feed("b") == (" <b", [])


@pytest.mark.parametrize("text, want", [
    ("<think>step one</think>\n\nThe answer.", ("step one", "\n\nThe answer.")),
    ("<think>cut off", ("cut off", "")),
    ("No thinking </think> here", (None, "No thinking </think> here")),
    ("<thin", (None, "<thin")),
])
def test_reasoning_is_split_at_the_end_of_thinking_whole_and_streamed(text, want):
    assert split_reasoning(text) == want
    for seed in range(20):
        rng, stream, got, i = random.Random(seed), ReasoningStream(), ["", ""], 0
        while i < len(text):
            j = i + rng.randint(1, 4)
            thought, answer = stream.feed(text[i:j])
            got, i = [got[0] + thought, got[1] + answer], j
        thought, answer = stream.finish()
        assert (got[0] + thought, got[1] + answer) == (want[0] or "", want[1])


def test_a_chat_message_and_its_stream_carry_reasoning_and_tool_calls():
    output = ChatOptions(reasoning_parser="qwen3").output(parse_tools=True, thinking=True)
    text = "<think>need weather</think>\n\n" + CALL
    message, called = output.message(text)
    assert called and message["reasoning_content"] == "need weather" and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "weather"
    stream, deltas = output.stream(), []
    for i in range(0, len(text), 7):
        deltas.append(stream.feed(text[i:i + 7], last=i + 7 >= len(text)))
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "need weather"
    assert not any(d.get("content") for d in deltas) and stream.called
    arguments = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
    assert arguments == message["tool_calls"][0]["function"]["arguments"]
    # no parser asked for: the text is the content as it is
    plain = ChatOptions().output(parse_tools=False, thinking=True)
    assert not plain.reads and plain.message(text) == ({"role": "assistant", "content": text}, False)


def test_unknown_parsers_are_refused_by_name():
    with pytest.raises(ValueError, match="--tool-call-parser 'mistral'"):
        ChatOptions(tool_call_parser="mistral")
    with pytest.raises(ValueError, match="--reasoning-parser 'r1'"):
        ChatOptions(reasoning_parser="r1")
