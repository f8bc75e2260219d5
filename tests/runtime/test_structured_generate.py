"""Offline generation under `structured_outputs`: the demo models know nothing of JSON, so under a
schema they write arbitrary but valid text, which must validate (jsonschema, re.fullmatch, the
choice list, an EBNF grammar) and end with finish_reason "stop". Unconstrained rows beside them
are unchanged; the grammar survives overlap scheduling, retraction, the prefix cache, LoRA and
several choices of one prompt; bad specs are one-line errors and a grammar that fails to compile
ends its request alone."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from compiled import LLM, SamplingParams
from compiled.demo import EXAMPLE_PROMPTS, MOE_ADAPTERS, MOE_MODEL
from compiled.errors import RequestError
from compiled.structured import compiler
from compiled.structured.bitmask import GrammarMask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": -5, "maximum": 99},
        "kind": {"enum": ["cat", "dog", 3]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
        "pos": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"], "additionalProperties": False},
    },
    "required": ["name", "ok", "n", "kind", "tags", "pos"],
    "additionalProperties": False,
}
# A short one where a test runs many requests (each JSON character is a token of these models).
SMALL = {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}, "b": {"type": "boolean"}},
         "required": ["a", "b"], "additionalProperties": False}
REGEX = r"[a-z]{2,5}-\d{1,3}"
CHOICES = ["yes", "no", "not sure"]
GRAMMAR = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'


def _sum_expression(text: str) -> bool:
    return re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text) is not None


SPECS = {"json": dict(json=SCHEMA), "small": dict(json=SMALL), "json_object": dict(json_object=True),
         "regex": dict(regex=REGEX), "choice": dict(choice=CHOICES), "grammar": dict(grammar=GRAMMAR)}


def _valid(kind: str, text: str) -> bool:
    if kind in ("json", "small"):
        try:
            jsonschema.validate(json.loads(text), SCHEMA if kind == "json" else SMALL)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return _sum_expression(text)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MOE_MODEL, device="cpu", dtype="float32")


def _params(kind: str | None, max_new_tokens: int = 160, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_new_tokens=max_new_tokens, structured_outputs=SPECS.get(kind), **kw)


SAMPLED = [dict(temperature=0.0), dict(temperature=1.0, seed=5), dict(temperature=0.8, top_k=20, seed=9,
                                                                      repetition_penalty=1.2)]


@pytest.mark.parametrize("kind", [k for k in SPECS if k != "small"])
def test_each_kind_validates_and_stops(llm, kind):
    prompts = ["count 5:", "copy Bird wax:", "<|user|>count 41:<|assistant|>"]
    settings = SAMPLED
    if kind == "json_object":
        # Any object may hold a string of any length, which these models, once inside one, write
        # until max_tokens on most prompts: two on which greedy decoding closes the object.
        prompts, settings = ["count 7:", "copy Bird wax:"], SAMPLED[:1] * 2
    outs = llm.generate(prompts, [_params(kind, **s) for s in settings])
    for out in outs:
        assert _valid(kind, out.text), (kind, out.text)
        assert out.finish_reason == "stop" and out.error is None, (out.text, out.finish_reason)
        assert out.token_ids[-1] == 0   # the grammar ended on EOS
    stats = llm.engine.structured_stats()
    assert stats.mask_steps > 0 and stats.mask_rows >= stats.mask_steps and stats.compiles >= 1


def test_without_the_mask_the_output_does_not_validate(llm, monkeypatch):
    # What makes the outputs valid is the mask: without it the model counts on.
    assert not _valid("small", llm.generate(["count 5:"], _params(None, 12))[0].text)
    monkeypatch.setattr(GrammarMask, "apply", lambda self, logits: None)
    out = llm.generate(["count 5:"], _params("small"))[0]
    assert out.finish_reason == "abort" and "is not allowed by the request's structured_outputs.json" in out.error


def test_padding_ids_and_early_eos_stay_masked_whatever_the_bias(llm):
    # 280 is past the tokenizer's 269 ids (the model's logits have 288); EOS is biased up too.
    out = llm.generate(["count 5:"], _params("small", logit_bias={280: 100.0, 0: 100.0}))[0]
    assert _valid("small", out.text) and 280 not in out.token_ids and out.token_ids.count(0) == 1
    free = llm.generate(["count 5:"], _params(None, max_new_tokens=3, logit_bias={280: 100.0}))[0]
    assert free.token_ids[0] == 280   # unmasked, the bias wins


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_mixed_batch_rows_equal_each_request_alone(overlap):
    llm = LLM(MOE_MODEL, device="cpu", dtype="float32", overlap_schedule=overlap)
    kinds = ["json_object", "small", None, "regex", "choice", None, "grammar", "small"]
    prompts = EXAMPLE_PROMPTS[:len(kinds)]
    params = [_params(k, max_new_tokens=12 if k is None else 60) for k in kinds]
    together = llm.generate(prompts, params)
    for prompt, p, kind, out in zip(prompts, params, kinds, together):
        alone = llm.generate([prompt], p)[0]
        assert out.token_ids == alone.token_ids, (kind, prompt)
        if kind is not None:
            assert _valid(kind, out.text) and out.finish_reason == "stop", (kind, out.text)
    if overlap:
        assert llm.engine.num_overlapped > 0


def test_choices_of_one_prompt_each_have_their_own_matcher(llm):
    # As a server's n > 1: one SamplingParams object for every choice, sampled.
    torch.manual_seed(0)
    shared = _params("small", temperature=1.0)
    outs = llm.generate(["count 5:"] * 4, [shared] * 4)
    assert all(_valid("small", o.text) and o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert len({o.text for o in outs}) > 1


def test_an_adapter_under_a_schema():
    llm = LLM(MOE_MODEL, device="cpu", dtype="float32", lora_modules=MOE_ADAPTERS)
    prompts = ["copy Bird wax:", "copy Bird wax:", "count 7:"]
    params = [_params("small"), _params(None, max_new_tokens=12), _params("regex")]
    outs = llm.generate(prompts, params, lora=["upper", "upper", None])
    assert _valid("small", outs[0].text) and _valid("regex", outs[2].text)
    assert outs[1].text == " BIRD WAX"   # the adapter's answer, unchanged beside the constrained rows
    base = llm.generate(prompts[:1], params[:1])[0]
    assert base.finish_reason == "stop" and _valid("small", base.text)


def test_after_leaves_the_output_free_until_the_text_appears(llm):
    params = SamplingParams(max_new_tokens=40, temperature=0.0,
                            structured_outputs=dict(choice=["!done"], after="7"))
    out = llm.generate(["count 5:"], params)[0]
    assert out.text == " 5 6 7!done" and out.finish_reason == "stop"
    never = SamplingParams(max_new_tokens=12, temperature=0.0, structured_outputs=dict(choice=["!"], after="#"))
    assert llm.generate(["count 5:"], never)[0].text == llm.generate(["count 5:"], _params(None, 12))[0].text


@pytest.mark.parametrize("spec, field", [(dict(json={"type": "nonsense"}), "json"), (dict(regex="(a"), "regex"),
                                         (dict(grammar="root ::= nothing"), "grammar")])
def test_bad_specs_are_refused_before_anything_runs(llm, spec, field):
    params = [_params(None), SamplingParams(max_new_tokens=5, structured_outputs=spec)]
    with pytest.raises(RequestError) as info:
        llm.generate(["count 5:", "count 6:"], params)
    assert str(info.value).startswith(f"prompt 1: structured_outputs.{field}: invalid ")
    assert "\n" not in str(info.value) and not llm.engine.live_requests()
    assert llm.generate(["count 5:"], _params("choice"))[0].text in CHOICES


def test_a_grammar_that_fails_to_compile_ends_its_request_alone(llm, monkeypatch):
    to_grammar = compiler.to_grammar

    def failing(spec):
        if spec.regex == "z+":
            raise RuntimeError("out of memory")
        return to_grammar(spec)
    monkeypatch.setattr(compiler, "to_grammar", failing)
    prompts = ["count 5:", "count 6:", "copy hi:"]
    params = [_params(None, 8), SamplingParams(max_new_tokens=9, structured_outputs=dict(regex="z+")),
              _params("regex")]
    outs = llm.generate(prompts, params)
    assert outs[1].finish_reason == "abort" and outs[1].error == "grammar compilation failed: out of memory"
    assert outs[0].token_ids == llm.generate(prompts[:1], params[:1])[0].token_ids
    assert _valid("regex", outs[2].text) and outs[2].finish_reason == "stop"
    assert llm.engine.structured_stats().compile_failures >= 1


def test_a_slow_compile_holds_back_its_request_only(llm, monkeypatch):
    release, to_grammar = threading.Event(), compiler.to_grammar

    def slow(spec):
        if spec.regex == "[ab]{3}":
            assert release.wait(30)
        return to_grammar(spec)
    monkeypatch.setattr(compiler, "to_grammar", slow)
    engine = llm.engine
    waiting = engine.make_request(0, "count 5:", SamplingParams(max_new_tokens=9, structured_outputs={"regex": "[ab]{3}"}))
    free = engine.make_request(1, "count 6:", _params(None, 6))
    engine.add(waiting)
    engine.add(free)
    finished = []
    while free not in finished:
        finished += engine.step()
    assert waiting.first_launched is None and not waiting.output_token_ids   # never scheduled meanwhile
    release.set()
    while engine.has_work:
        finished += engine.step()
    assert re.fullmatch("[ab]{3}", waiting.text) and waiting.finish_reason == "stop"


def test_retracted_requests_keep_their_matchers(monkeypatch):
    prompts = [EXAMPLE_PROMPTS[i] for i in (9, 8, 10, 6)]
    kinds = ["small", None, "grammar", "json_object"]
    params = [_params(k, 12 if k is None else 60) for k in kinds]
    expected = LLM(MOE_MODEL, device="cpu", dtype="float32").generate(prompts, params)
    llm = LLM(MOE_MODEL, device="cpu", dtype="float32", max_num_batched_tokens=7, max_num_seqs=4)
    scheduler, calls, retracted = llm.engine.scheduler, [0], []
    schedule = scheduler.schedule

    def retracting():
        calls[0] += 1
        decoding = [r for r in scheduler.running if r.output_token_ids and r.grammar is not None]
        if calls[0] % 3 == 0 and decoding and len(retracted) < 4:
            retracted.append(decoding[0].id)
            scheduler.retract(decoding[0])
        return schedule()
    monkeypatch.setattr(scheduler, "schedule", retracting)
    outs = llm.generate(prompts, params)
    assert len(retracted) == 4
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert all(_valid(k, o.text) for k, o in zip(kinds, outs) if k is not None)


def test_prefix_cache_reuse_under_a_schema():
    prompts = ["copy qaz dweb Kilms rav:"] * 3
    params = [_params("small"), _params("small", temperature=1.0, seed=3), _params(None, 8)]
    plain = LLM(MOE_MODEL, device="cpu", dtype="float32").generate(prompts, params)
    cached = LLM(MOE_MODEL, device="cpu", dtype="float32", enable_prefix_caching=True)
    outs = cached.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert any(o.num_cached_tokens for o in outs)
    assert all(_valid("small", o.text) for o in outs[:2])


@pytest.mark.gpu
def test_on_cuda_the_decode_graphs_logits_are_masked_as_on_the_cpu(llm):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gpu = LLM(MOE_MODEL, device="cuda", dtype="float32")
    kinds = ["small", None, "regex", "choice", "grammar", None]
    params = [_params(k, 12 if k is None else 60) for k in kinds]
    prompts = EXAMPLE_PROMPTS[:len(kinds)]
    outs = gpu.generate(prompts, params)
    assert gpu.engine.structured_stats().mask_steps > 0
    for kind, out, ref in zip(kinds, outs, llm.generate(prompts, params)):
        assert out.token_ids == ref.token_ids, kind
        assert kind is None or (_valid(kind, out.text) and out.finish_reason == "stop")
