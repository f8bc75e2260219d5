"""Request fields the server does not serve are 400s naming them; their no-op values pass; fields
it does not know are 400s naming them (with what serves another server's field here).
`logit_bias` arrives with token ids as JSON strings; completions' `echo` with logprobs asks the
engine for the prompt's."""

from __future__ import annotations

import pytest

from compiled.server.protocol import APIError, known_fields, sampling


def _check(body: dict, chat: bool = False) -> None:
    body = {"prompt": "x", "max_tokens": 4, **body}
    known_fields(body, chat)
    sampling(body, prompt_len=3, context=64, chat=chat)


@pytest.mark.parametrize("field, value", [("suffix", "end"),
                                          ("tools", [{"type": "function"}]), ("tool_choice", "required"),
                                          ("prediction", {}), ("audio", {"voice": "x"}),
                                          ("functions", [{"name": "f"}]), ("best_of", 3), ("echo", 1)])
def test_an_unserved_field_is_a_400_naming_it(field, value):
    with pytest.raises(APIError) as e:
        _check({field: value})
    assert e.value.status == 400 and e.value.param == field and field in e.value.message


@pytest.mark.parametrize("body", [{"echo": False}, {"logit_bias": {}}, {"suffix": ""},
                                  {"response_format": {"type": "text"}}, {"best_of": 2, "n": 2},
                                  {"logit_bias": None}, {"user": "someone"}, {"metadata": {"k": "v"}}])
def test_no_op_values_pass(body):
    _check(body)


@pytest.mark.parametrize("body", [{"tools": [], "tool_choice": "none", "parallel_tool_calls": True},
                                  {"modalities": ["text"]}, {"functions": []}, {"chat_template_kwargs": {}}])
def test_chat_no_op_values_pass(body):
    body = {"messages": [], "max_tokens": 4, **body}
    known_fields(body, chat=True)
    sampling(body, prompt_len=3, context=64, chat=True)


@pytest.mark.parametrize("body, chat, field", [({"temprature": 0}, False, "temprature"),
                                               ({"guided_json": {}}, True, "guided_json"),
                                               ({"messages": []}, False, "messages"),
                                               ({"chat_template_kwargs": {}}, False, "chat_template_kwargs"),
                                               ({"best_of": 1}, True, "best_of")])
def test_an_unknown_field_is_a_400_naming_it(body, chat, field):
    with pytest.raises(APIError) as e:
        known_fields({"model": "m", **body}, chat)
    assert e.value.status == 400 and e.value.param == field and field in e.value.message
    if field == "guided_json":
        assert "structured_outputs.json" in e.value.message


def test_echo_serves_completions_and_asks_for_prompt_logprobs_with_logprobs():
    s = sampling({"prompt": "x", "max_tokens": 4, "echo": True, "logprobs": 2}, 3, 64, chat=False)
    assert s.echo and s.params[0].prompt_logprobs == 2
    s = sampling({"prompt": "x", "max_tokens": 4, "echo": True}, 3, 64, chat=False)
    assert s.echo and s.params[0].prompt_logprobs is None
    with pytest.raises(APIError) as e:
        sampling({"messages": [], "max_tokens": 4, "echo": True}, 3, 64, chat=True)
    assert e.value.param == "echo"


def test_echo_with_max_tokens_0_asks_for_the_prompt_alone():
    s = sampling({"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 1}, 3, 64, chat=False)
    assert s.prompt_only and s.params[0].max_new_tokens == 1 and s.params[0].prompt_logprobs == 1
    with pytest.raises(APIError) as e:
        _check({"max_tokens": 0})
    assert e.value.param == "max_tokens"


def test_logit_bias_keys_become_token_ids():
    s = sampling({"prompt": "x", "max_tokens": 4, "logit_bias": {"5": 10, "7": -100}}, 3, 64, chat=False)
    assert s.params[0].logit_bias == {5: 10.0, 7: -100.0}


@pytest.mark.parametrize("bias", [{"five": 1}, {"5": 101}, {"5": "up"}, [5, 1], {"-5": 1}])
def test_a_bad_logit_bias_is_a_400_naming_it(bias):
    with pytest.raises(APIError) as e:
        _check({"logit_bias": bias})
    assert e.value.status == 400 and e.value.param == "logit_bias"
