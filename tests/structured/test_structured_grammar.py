"""Specs become grammars: bad ones are one-line errors naming the field; JSON is compact (no free
whitespace, no unknown properties); padding ids are never allowed and EOS only where the grammar
may end; grammars compile once per spec."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from compiled.demo import MOE_MODEL
from compiled.runtime.tokenizer import load_tokenizer
from compiled.structured.bitmask import allowed_ref, bitmask_width
from compiled.structured.compiler import GrammarCache, vocabulary
from compiled.structured.grammar import check
from compiled.structured.spec import StructuredOutputs

EOS, MODEL_VOCAB = 0, 288   # the demo MoE model: tokenizer of 269 ids, logits of 288


@pytest.fixture(scope="module")
def vocab():
    tokenizer = load_tokenizer(MOE_MODEL)
    return vocabulary(tokenizer.hf, MODEL_VOCAB, [EOS]), tokenizer


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "nonsense"}), 'structured_outputs.json: invalid JSON schema: Unsupported type "nonsense"'),
    (dict(json='{"type": '), "structured_outputs.json: invalid JSON schema: Expecting value"),
    (dict(json={"type": "integer", "minimum": "x"}), "structured_outputs.json: invalid JSON schema:"),
    (dict(json="[1, 2]"), "structured_outputs.json: invalid JSON schema: a schema is an object or a boolean"),
    (dict(regex="a(b"), "structured_outputs.regex: invalid regex: Regex parsing error at position 4"),
    (dict(grammar='root ::= "a'), "structured_outputs.grammar: invalid EBNF grammar: EBNF lexer error"),
    (dict(grammar="root ::= missing"), 'structured_outputs.grammar: invalid EBNF grammar: EBNF parser error'),
])
def test_bad_specs_are_one_line_errors_naming_the_field(spec, message):
    with pytest.raises(ValueError) as info:
        check(spec)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text and "/project/" not in text, text


def test_check_takes_a_dict_or_a_spec_and_refuses_two_kinds():
    assert check({"regex": "a+"}) == StructuredOutputs(regex="a+")
    with pytest.raises(ValueError, match="exactly one of"):
        check({"regex": "a+", "choice": ["a"]})


def _allowed(matcher: xgr.GrammarMatcher, size: int) -> set[int]:
    bitmask = torch.zeros(1, bitmask_width(size), dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return set(allowed_ref(bitmask, size)[0].nonzero().flatten().tolist())


def _matcher(vocab, spec: dict) -> xgr.GrammarMatcher:
    cache = GrammarCache(lambda: vocab[0], workers=1)
    return xgr.GrammarMatcher(cache.get(StructuredOutputs(**spec)).result(timeout=60))


def _accept(matcher: xgr.GrammarMatcher, tokenizer, text: str) -> bool:
    return all(matcher.accept_token(t) for t in tokenizer.encode(text))


def test_json_is_compact_and_eos_comes_only_at_the_end(vocab):
    v, tokenizer = vocab
    space = tokenizer.encode(" ")[0]
    m = _matcher(vocab, dict(json={"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}))
    allowed = _allowed(m, v.size)
    assert EOS not in allowed and space not in allowed
    assert all(t < 269 for t in allowed), "a padding id is allowed"
    assert _accept(m, tokenizer, '{"a":')
    assert space not in _allowed(m, v.size)
    assert _accept(m, tokenizer, "true}")
    assert _allowed(m, v.size) == {EOS}
    assert m.accept_token(EOS) and m.is_terminated()


def test_json_refuses_unknown_properties_and_json_object_takes_any(vocab):
    _, tokenizer = vocab
    strict = _matcher(vocab, dict(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert not _accept(strict, tokenizer, '{"b":')
    anything = _matcher(vocab, dict(json_object=True))
    assert _accept(anything, tokenizer, '{"b":[1,{"c":null}],"d":"e"}')
    assert not _accept(_matcher(vocab, dict(json_object=True)), tokenizer, "[")


def test_choice_matches_its_literals_only(vocab):
    _, tokenizer = vocab
    choices = ['say "hi"', "a\\b", "x"]
    for c in choices:
        m = _matcher(vocab, dict(choice=choices))
        assert _accept(m, tokenizer, c) and m.accept_token(EOS), c
    assert not _accept(_matcher(vocab, dict(choice=choices)), tokenizer, "say hi")


def test_a_spec_compiles_once(vocab):
    cache = GrammarCache(lambda: vocab[0], workers=1)
    first = cache.get(StructuredOutputs(json={"type": "boolean"}))
    # the same schema as JSON text, keys in another order: the same grammar
    again = cache.get(StructuredOutputs(json='{"type": "boolean"}'))
    assert again is first
    first.result(timeout=60)
    stats = cache.stats.snapshot()
    assert (stats.requests, stats.compiles, stats.compile_cache_hits) == (2, 1, 1)
    assert stats.compile_seconds_p50 > 0


def test_stats_percentiles_are_nearest_rank_over_the_latest_samples():
    from compiled.structured.stats import WINDOW, StatsRecorder, percentile
    assert (percentile(range(1, 101), 50), percentile(range(1, 101), 99), percentile([], 50)) == (50, 99, 0.0)
    recorder = StatsRecorder()
    for i in range(WINDOW + 100):
        recorder.masked(2, 1.0 if i < 100 else 0.001 * (i % 10))
    s = recorder.snapshot()
    assert (s.mask_steps, s.mask_rows) == (WINDOW + 100, 2 * (WINDOW + 100))
    assert s.mask_seconds_p99 == pytest.approx(0.009) and s.mask_seconds_p50 == pytest.approx(0.004)
