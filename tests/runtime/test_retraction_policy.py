"""The retraction policy: a prefill never retracts another request (it takes the free slots or
waits), a decoding request without a slot retracts the one whose recomputation costs least, and a
retracted request comes back only when all its tokens fit. On a small version of
bench/retraction_stress.py's workload the engine computes at most 1.15x the tokens the requests
need, and every greedy output equals the request run alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from compiled import LLM, SamplingParams
from compiled.attention.kv_cache import KVPool, ReqToTokenPool
from compiled.demo import MOE_MODEL
from compiled.runtime.request import Request
from compiled.runtime.scheduler import Scheduler

_spec = importlib.util.spec_from_file_location(
    "retraction_stress", Path(__file__).resolve().parents[2] / "bench" / "retraction_stress.py")
stress = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stress)

# 20 requests (seed 0): 80% prompts of 2-6 tokens, 20% of 16-40, 1-8 new tokens each, on a KV
# cache of 48 tokens with a 16-token step budget; the newest-first rule computed 1.57x here.
SMALL = dict(short=(2, 6), long=(16, 40), long_fraction=0.2, output=(1, 8))
ENGINE = dict(device="cpu", dtype="float32", kv_cache_tokens=48, max_model_len=48, max_num_seqs=6,
              max_num_batched_tokens=16)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MOE_MODEL, **ENGINE)


def test_small_stress_recomputes_little_and_equals_solo(llm):
    items = stress.stress_workload(20, llm.model_config.vocab_size, seed=0, **SMALL)
    res, requests = stress.run_workload(llm, items)
    assert res["retractions"] > 0, "the workload no longer fills the KV cache"
    assert res["tokens_computed"] <= 1.15 * res["tokens_needed"], res
    assert llm.engine.kv.num_used == 0 and not llm.engine.has_work
    for (ids, n), request in zip(items, requests):
        assert llm.generate([ids], _greedy(n))[0].token_ids == request.output_token_ids


def test_two_requests_retract_once(llm):
    """a decodes while b's long prompt is part-way through its prefill, and both cannot fit: b is
    retracted once and comes back when all of it fits (newest first retracted it 8 times here,
    readmitting it each time to recompute its first chunk)."""
    retractions = llm.engine.scheduler.num_retractions
    prompts, params = [[5] * 24, [7] * 32], [_greedy(16), _greedy(8)]
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_retractions - retractions == 1
    for out, prompt, p in zip(outs, prompts, params):
        assert out.token_ids == llm.generate([prompt], p)[0].token_ids


# ---- the scheduler alone ------------------------------------------------------------------

def _scheduler(slots: int, budget: int) -> Scheduler:
    kv = KVPool(1, slots, 1, 4, torch.float32, torch.device("cpu"))
    return Scheduler(kv, ReqToTokenPool(8, slots, torch.device("cpu")), 8, budget)


def _request(i: int, prompt: int, out: int) -> Request:
    return Request(id=i, prompt=None, prompt_token_ids=[1] * prompt, params=_greedy(out))


def _step(s: Scheduler) -> list[tuple[int, int, int]]:
    """Schedule one step; each chunk that reaches its request's end "samples" a token, and a
    request with all its tokens finishes. Returns (request id, start, length) per chunk."""
    batch = s.schedule()
    for c in batch.chunks:
        if c.samples:
            c.request.output_token_ids.append(3)
            if len(c.request.output_token_ids) == c.request.params.max_new_tokens:
                s.finish(c.request)
    return [(c.request.id, c.start, c.length) for c in batch.chunks]


def test_prefill_waits_instead_of_retracting():
    s = _scheduler(slots=24, budget=16)
    a, b = _request(0, 10, out=4), _request(1, 20, out=4)
    s.add(a)
    s.add(b)
    assert _step(s) == [(0, 0, 10), (1, 0, 6)]
    # b takes what is free beyond a's decode slot and one slot per running request: 7 - 2.
    assert _step(s) == [(0, 10, 1), (1, 6, 5)]
    assert _step(s) == [(0, 11, 1)]          # nothing left for b: it waits, keeping its 11 tokens
    assert _step(s) == [(0, 12, 1)]          # a finishes
    assert _step(s) == [(1, 11, 9)]
    assert s.num_retractions == 0


def test_decode_retracts_the_cheapest():
    s = _scheduler(slots=22, budget=20)
    a, b, c = _request(0, 8, out=8), _request(1, 3, out=8), _request(2, 8, out=8)
    for r in (a, b, c):
        s.add(r)
    assert _step(s) == [(0, 0, 8), (1, 0, 3), (2, 0, 8)]
    assert _step(s) == [(0, 8, 1), (1, 3, 1), (2, 8, 1)]
    assert s.kv.num_free == 0
    # Three decoding requests, no free slot: b (4 tokens) goes, not the newest (c, 9 tokens).
    assert _step(s) == [(0, 9, 1), (2, 9, 1)]
    assert s.num_retractions == 1 and s.waiting[0] is b and b.num_computed == 0


def test_retracted_request_returns_only_when_it_fits_whole():
    s = _scheduler(slots=12, budget=4)
    a, b = _request(0, 4, out=6), _request(1, 4, out=8)
    s.add(a)
    s.add(b)
    assert _step(s) == [(0, 0, 4)]
    assert _step(s) == [(0, 4, 1), (1, 0, 3)]
    assert _step(s) == [(0, 5, 1), (1, 3, 1)]
    assert _step(s) == [(0, 6, 1), (1, 4, 1)]
    # KV full: b (5 tokens) is cheaper than a (7). Its first chunk of 3 would fit now, but not
    # all its 6 tokens beside a: it stays out, instead of being readmitted to be retracted again.
    assert _step(s) == [(0, 7, 1)]
    assert s.waiting[0] is b and s.num_retractions == 1
    assert _step(s) == [(0, 8, 1)]           # a finishes
    assert _step(s) == [(1, 0, 4)]
    assert s.num_retractions == 1


def test_rollback_keeps_a_readmitted_request_marked_as_retracted():
    """A step that fails after readmitting a retracted request puts it back under the rule for
    retracted requests (it returns only when it fits whole), not the looser rule of new ones."""
    s = _scheduler(slots=12, budget=4)
    a, b = _request(0, 4, out=6), _request(1, 4, out=8)
    s.add(a)
    s.add(b)
    for _ in range(5):
        _step(s)
    assert s.waiting[0] is b and b.id in s._retracted
    for _ in range(2):                       # a finishes; b is readmitted
        batch = s.schedule()
        if any(c.request is b for c in batch.chunks):
            break
        for c in batch.chunks:
            c.request.output_token_ids.append(3)
            if len(c.request.output_token_ids) == c.request.params.max_new_tokens:
                s.finish(c.request)
    assert any(c.request is b and c.readmitted for c in batch.chunks) and b.id not in s._retracted
    s.rollback(batch)
    assert s.waiting[0] is b and b.id in s._retracted and b.num_computed == 0
