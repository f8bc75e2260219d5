"""Overlap scheduling: a decode step launched before the previous step's tokens are read back gives
the same outputs as the synchronous engine (tokens, text, finish reasons, logprobs), drops the
token it computed ahead for a request that a stop string or EOS ended, frees every KV slot, and
falls back to synchronous steps for rows whose next step needs their tokens on the host."""

from __future__ import annotations

import pytest

from compiled import LLM, SamplingParams
from compiled.demo import EXAMPLE_PROMPTS, MOE_MODEL
from compiled.runtime.request import Request


def _llm(overlap: bool, **kw) -> LLM:
    return LLM(MOE_MODEL, device="cpu", dtype="float32", overlap_schedule=overlap, **kw)


@pytest.fixture(scope="module")
def engines():
    return _llm(True), _llm(False)


def _mixed_params(stop: str) -> list[SamplingParams]:
    """One row per kind of request: lengths that end on different steps, a stop string, an EOS
    that counts, seeded and unseeded sampling, min_new_tokens, logprobs, penalties."""
    g = dict(temperature=0.0)
    return [
        SamplingParams(max_new_tokens=40, **g),
        SamplingParams(max_new_tokens=3, **g),
        SamplingParams(max_new_tokens=40, stop=[stop], **g),
        SamplingParams(max_new_tokens=17, temperature=0.9, seed=7),
        SamplingParams(max_new_tokens=25, min_new_tokens=12, **g),
        SamplingParams(max_new_tokens=9, logprobs=2, **g),
        SamplingParams(max_new_tokens=30, repetition_penalty=1.3, **g),
        SamplingParams(max_new_tokens=1, **g),
        SamplingParams(max_new_tokens=22, temperature=1.0, top_k=5, seed=3, presence_penalty=0.5),
        SamplingParams(max_new_tokens=33, **g),
        SamplingParams(max_new_tokens=12, temperature=0.7, seed=11, stop=[stop]),
        SamplingParams(max_new_tokens=64, **g),
    ]


def _same(a, b) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert [(o.finish_reason, o.stop_reason) for o in a] == [(o.finish_reason, o.stop_reason) for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]


def test_mixed_batch_equals_synchronous(engines):
    on, off = engines
    third = off.generate([EXAMPLE_PROMPTS[2]], SamplingParams(max_new_tokens=40, temperature=0.0))[0]
    stop = third.text[4:7]  # ends row 2 after a few tokens
    params = _mixed_params(stop)
    before = on.engine.num_overlapped
    overlapped = on.generate(EXAMPLE_PROMPTS, params)
    assert on.engine.num_overlapped > before
    plain = off.generate(EXAMPLE_PROMPTS, params)
    assert off.engine.num_overlapped == 0
    _same(overlapped, plain)
    assert overlapped[2].finish_reason == "stop" and overlapped[2].stop_reason == stop
    assert [len(o.token_ids) for o in overlapped][:2] == [40, 3] and len(overlapped[7].token_ids) == 1
    for llm in engines:
        assert llm.engine.kv.num_used == 0 and not llm.engine.has_work


def test_greedy_batch_overlaps_every_decode_step(engines):
    """All rows alike: every step after the prefill is launched ahead, and the answer is the same."""
    on, off = engines
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    before = on.engine.num_overlapped
    overlapped = on.generate(EXAMPLE_PROMPTS[:5], params)
    # 20 tokens: the prefill samples the first, then 19 decode steps; the last one is read back
    # at once (nothing follows it), so 19 launches happen ahead of a read.
    assert on.engine.num_overlapped - before == 19
    _same(overlapped, off.generate(EXAMPLE_PROMPTS[:5], params))


def test_stop_token_drops_the_token_computed_ahead(engines):
    """A stop token id ends a request on a step whose successor is already running: the successor's
    token for it is discarded, the others carry on."""
    on, off = engines
    ref = off.generate([EXAMPLE_PROMPTS[3]], SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))[0]
    stop_id = ref.token_ids[6]
    params = [SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
              SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)]
    prompts = [EXAMPLE_PROMPTS[3], EXAMPLE_PROMPTS[5]]
    overlapped = on.generate(prompts, params)
    n = ref.token_ids.index(stop_id) + 1
    assert overlapped[0].token_ids == ref.token_ids[:n] and overlapped[0].finish_reason == "stop"
    _same(overlapped, off.generate(prompts, params))
    assert on.engine.kv.num_used == 0


def test_under_pressure_equals_synchronous():
    """Queueing (more prompts than max_num_seqs), chunked prefill and retraction: steps that
    admit or retract run synchronously, the rest overlap; the tokens are the same."""
    kw = dict(max_num_seqs=3, max_num_batched_tokens=16, kv_cache_tokens=100, max_model_len=100)
    params = SamplingParams(max_new_tokens=48, temperature=0.0)
    on, off = _llm(True, **kw), _llm(False, **kw)
    overlapped = on.generate(EXAMPLE_PROMPTS, params)
    _same(overlapped, off.generate(EXAMPLE_PROMPTS, params))
    assert on.engine.scheduler.num_retractions > 0 and on.engine.num_overlapped > 0
    assert on.engine.kv.num_used == 0


def test_pending_tokens_read_as_zero_until_resolved():
    r = Request(id=0, prompt=None, prompt_token_ids=[5, 6, 7], params=SamplingParams(), output_token_ids=[8])
    r.pending = 1
    assert r.num_tokens == 5 and r.num_resolved == 4
    assert r.token_ids(2, 5) == [7, 8, 0] and r.token_ids(4, 5) == [0] and r.token_ids(0, 4) == [5, 6, 7, 8]


def test_tokens_in_flight_come_back_before_a_step_that_cannot_overlap(engines):
    """A request arriving while a decode step is in flight: the next call hands back that step's
    tokens without running the new prompt's prefill, which would otherwise hold them back for
    its whole run; the call after runs it."""
    engine = engines[0].engine
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0)
    running = engine.make_request(0, [5, 6, 7, 8], greedy)
    engine.add(running)
    overlapped = engine.num_overlapped
    while engine.num_overlapped < overlapped + 2:   # steady decoding, a step launched ahead
        engine.step()
    arriving = engine.make_request(1, list(range(3, 40)), greedy)
    engine.add(arriving)
    n = len(running.output_token_ids)
    engine.step()
    assert len(running.output_token_ids) == n + 1 and arriving.num_computed == 0
    engine.step()
    assert arriving.num_computed > 0
    while engine.has_work:
        engine.step()
    assert engine.kv.num_used == 0


def test_a_finish_hands_back_its_step_without_waiting_for_the_one_behind(engines):
    """Two requests decoding with a step launched ahead; one ends at a stop token on the step being
    read: the call returns with that step's tokens (one more for the other request), leaving the
    step behind it unread for the next call, which reads it without launching anything."""
    on, off = engines
    prompt = [5, 6, 7, 8]
    ref = off.generate([prompt], SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))[0].token_ids
    stop_id = ref[6]
    engine = on.engine
    short = engine.make_request(0, prompt, SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True,
                                                          stop_token_ids=[stop_id]))
    long = engine.make_request(1, [9, 3, 4], SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))
    engine.add(short), engine.add(long)
    finished = []
    while not finished:
        n = len(long.output_token_ids)
        overlapped = engine.num_overlapped
        finished = engine.step()
    assert finished == [short] and short.output_token_ids == ref[:ref.index(stop_id) + 1]
    assert engine.num_overlapped == overlapped + 1
    assert len(long.output_token_ids) == n + 1 and len(engine._unread) == 1
    engine.step()
    assert len(long.output_token_ids) == n + 2 and not engine._unread
    while engine.has_work:
        engine.step()
    assert engine.kv.num_used == 0
