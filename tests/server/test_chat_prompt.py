"""A chat's prompt: message content as a string or as OpenAI's list of text parts (other parts are
400s naming `messages`), and `chat_template_kwargs` passed to the template as variables."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from compiled.demo import MOE_MODEL
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
