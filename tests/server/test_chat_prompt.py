"""A chat's prompt: message content as a string or as OpenAI's list of text parts (other parts are
400s naming `messages`), `chat_template_kwargs` passed to the template as variables, and the demo
models' template rendering tools, tool calls and tool results as Qwen3's does."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from compiled.demo import DENSE_MODEL, MOE_MODEL
from compiled.runtime.tokenizer import load_tokenizer
from compiled.server.protocol import APIError
from compiled.server.serving import Server


def _server(tokenizer) -> Server:
    server = Server.__new__(Server)
    server.tokenizer = tokenizer
    return server


def test_text_parts_are_the_string_they_join_to():
    server = _server(load_tokenizer(MOE_MODEL))
    plain = server.chat_prompt({"messages": [{"role": "user", "content": "copy hi:\nand more"}]})
    parts = server.chat_prompt({"messages": [{"role": "user", "content": [{"type": "text", "text": "copy hi:"},
                                                                         {"type": "text", "text": "and more"}]}]})
    assert parts == plain


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
])
def test_unserved_content_and_bad_template_kwargs_are_400s(body, param):
    with pytest.raises(APIError) as e:
        _server(load_tokenizer(MOE_MODEL)).chat_prompt(body)
    assert e.value.status == 400 and e.value.param == param


def test_chat_template_kwargs_reach_the_template():
    seen = {}
    tokenizer = SimpleNamespace(apply_chat_template=lambda messages, **kw: seen.update(kw) or "text",
                                encode=lambda text: [1, 2])
    ids = _server(tokenizer).chat_prompt({"messages": [{"role": "user", "content": "hi"}],
                                          "chat_template_kwargs": {"enable_thinking": False}})
    assert ids == [1, 2] and seen == {"enable_thinking": False}


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}}
TURNS = [{"role": "user", "content": "copy hi:"}, {"role": "assistant", "content": " hi"},
         {"role": "user", "content": "count 5:"}]


@pytest.mark.parametrize("model, eos", [(MOE_MODEL, "<|endoftext|>"), (DENSE_MODEL, "</s>")])
def test_the_demo_template_renders_tools_calls_and_results_as_qwen3_does(model, eos):
    tokenizer = load_tokenizer(model)
    # plain turns as the models were trained on them, tools or not
    assert tokenizer.apply_chat_template(TURNS) == f"<|user|>copy hi:<|assistant|> hi{eos}<|user|>count 5:<|assistant|>"
    calls = [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": {"city": "Rome"}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]
    text = tokenizer.apply_chat_template(messages, tools=[TOOL], enable_thinking=False)
    tools_block = "<tools>\n" + json.dumps(TOOL) + "\n</tools>"
    assert text.startswith("Be brief.\n\n# Tools\n\n" + tools_block)
    assert text.endswith(
        '<|user|>weather?<|assistant|><tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>' + eos +
        "<|user|>\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|assistant|><think>\n\n</think>\n\n")


def test_an_assistant_turn_with_tool_calls_may_have_no_content_and_bad_calls_are_400s():
    server = _server(load_tokenizer(MOE_MODEL))
    call = {"id": "c", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    ids = server.chat_prompt({"messages": [{"role": "user", "content": "x"},
                                           {"role": "assistant", "content": None, "tool_calls": [call]},
                                           {"role": "tool", "tool_call_id": "c", "content": "ok"}]}, [TOOL])
    assert "<tool_response>\nok\n</tool_response>" in server.tokenizer.decode(ids, skip_special_tokens=False)
    for bad_calls in ([{"function": {"arguments": "{}"}}], "weather", [{"function": {"name": "w", "arguments": 5}}]):
        with pytest.raises(APIError) as e:
            server.chat_prompt({"messages": [{"role": "assistant", "content": None, "tool_calls": bad_calls}]})
        assert e.value.param == "messages" and "tool_calls" in e.value.message
