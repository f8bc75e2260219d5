"""Bad requests are one-line errors that name the culprit and lose nothing already queued;
more requests than fit queue, and KV exhaustion retracts and resumes instead of crashing."""

from __future__ import annotations

import pytest

from compiled import LLM, SamplingParams
from compiled.errors import RequestError
from tests.conftest import make_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("ckpt"), moe=True)
    return LLM(path, device="cpu", max_model_len=64)


def test_empty_prompt(llm):
    with pytest.raises(RequestError, match="prompt 1 is empty"):
        llm.generate([[1, 2], []])


def test_prompt_longer_than_context(llm):
    with pytest.raises(RequestError, match="prompt 0 has 70 tokens; the context holds 64"):
        llm.generate([[1] * 70])


def test_token_outside_vocab(llm):
    with pytest.raises(RequestError, match="prompt 0 has token id 999"):
        llm.generate([[1, 999]])


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate(["hello"])


def test_bad_request_loses_nothing(llm):
    """A rejected call queues nothing; the engine serves the next call normally."""
    with pytest.raises(RequestError):
        llm.generate([[1, 2, 3], []])
    assert not llm.engine.has_work
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_generation_stops_at_context(llm):
    out = llm.generate([[5] * 60], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[1]], [SamplingParams(), SamplingParams()])
