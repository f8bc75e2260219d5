"""Retraction and resumption at any point (part-way through a prompt, at chunk boundaries that
differ on the recompute, while decoding) leave every result as when the request runs alone:
token ids, text, logprobs and prompt logprobs, one entry per prompt token, each for its own
position."""

from __future__ import annotations

from collections import Counter

import pytest

from compiled import LLM, SamplingParams
from compiled.demo import EXAMPLE_PROMPTS, MOE_MODEL
from compiled.runtime.request import Logprobs, Request, RequestOutput
from compiled.runtime.scheduler import Batch, Scheduler

PROMPTS = [EXAMPLE_PROMPTS[i] for i in (9, 8, 10, 6)]  # 14, 21, 23 and 17 tokens
# An odd token budget shared by several requests: chunks start at irregular positions, and a
# recompute after a retraction splits the prompt differently from the first pass.
TIGHT = dict(max_num_batched_tokens=7, max_num_seqs=4)


def _params() -> list[SamplingParams]:
    both = dict(logprobs=2, prompt_logprobs=2, max_new_tokens=8)
    return [
        SamplingParams(temperature=0.0, ignore_eos=True, **both),
        SamplingParams(temperature=0.8, seed=4, **both),
        SamplingParams(temperature=0.0, **both),
        SamplingParams(temperature=1.0, top_k=5, seed=8, ignore_eos=True, **both),
    ]


def _llm(**settings) -> LLM:
    return LLM(MOE_MODEL, device="cpu", dtype="float32", **settings)


@pytest.fixture(scope="module")
def alone() -> list[RequestOutput]:
    llm = _llm()
    return [llm.generate([p], sp)[0] for p, sp in zip(PROMPTS, _params())]


def _values(entries: list[Logprobs | None]) -> list[float]:
    return [entry[token] for entry in entries if entry is not None for token in sorted(entry)]


def _same_as_alone(outs: list[RequestOutput], alone: list[RequestOutput]) -> None:
    for out, ref in zip(outs, alone):
        assert out.token_ids == ref.token_ids and out.text == ref.text
        assert out.finish_reason == ref.finish_reason
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
        assert len(out.logprobs) == len(out.token_ids)
        for mine, theirs in ((out.prompt_logprobs, ref.prompt_logprobs), (out.logprobs, ref.logprobs)):
            # The same tokens at every position; values to float rounding (other batch shapes).
            assert [None if e is None else sorted(e) for e in mine] == [None if e is None else sorted(e) for e in theirs]
            assert _values(mine) == pytest.approx(_values(theirs), abs=1e-4)


def _record_retractions(scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(prompt length, tokens computed, tokens generated) of each request when retracted."""
    seen: list[tuple[int, int, int]] = []
    retract = scheduler.retract

    def recording_retract(request: Request) -> None:
        seen.append((len(request.prompt_token_ids), request.num_computed, len(request.output_token_ids)))
        retract(request)
    monkeypatch.setattr(scheduler, "retract", recording_retract)
    return seen


def _mid_prompt(seen: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    return [s for s in seen if 0 < s[1] < s[0]]


def test_kv_pressure_retracts_and_results_equal_alone(alone, monkeypatch):
    # 48 slots: prefills wait for room instead of retracting, so it takes decoding requests
    # running out of slots (twice here) to retract.
    llm = _llm(kv_cache_tokens=48, max_model_len=48, **TIGHT)
    seen = _record_retractions(llm.engine.scheduler, monkeypatch)
    _same_as_alone(llm.generate(PROMPTS, _params()), alone)
    assert seen, "the small KV cache retracted nothing"
    assert llm.engine.kv.num_used == 0


def _part_way_through_prompt(request: Request) -> bool:
    return 0 < request.num_computed < len(request.prompt_token_ids)


def _decoding(request: Request) -> bool:
    return bool(request.output_token_ids)


def _retract_every(scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch, period: int, limit: int) -> None:
    """Before every `period`-th scheduling, retract a running request, `limit` times in all:
    alternately one part-way through its prompt and one decoding, the least retracted of its
    kind first. These are points KV pressure alone may not reach."""
    schedule, calls, times = scheduler.schedule, [0], Counter()

    def retracting_schedule() -> Batch | None:
        calls[0] += 1
        done = sum(times.values())
        if calls[0] % period == 0 and done < limit:
            kind = _part_way_through_prompt if done % 2 == 0 else _decoding
            candidates = [r for r in scheduler.running if kind(r)]
            if candidates:
                victim = min(candidates, key=lambda r: times[r.id])
                times[victim.id] += 1
                scheduler.retract(victim)
        return schedule()
    monkeypatch.setattr(scheduler, "schedule", retracting_schedule)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_forced_retractions_mid_prompt_and_mid_decode_equal_alone(overlap, alone, monkeypatch):
    llm = _llm(overlap_schedule=overlap, **TIGHT)
    scheduler = llm.engine.scheduler
    seen = _record_retractions(scheduler, monkeypatch)
    _retract_every(scheduler, monkeypatch, period=2, limit=10)
    _same_as_alone(llm.generate(PROMPTS, _params()), alone)
    mid_prompt = _mid_prompt(seen)
    assert mid_prompt, f"no retraction part-way through a prompt: {seen}"
    assert any(computed % TIGHT["max_num_batched_tokens"] for _, computed, _ in mid_prompt), \
        f"every retraction mid-prompt was at a chunk boundary of the first pass: {seen}"
    assert any(generated for _, _, generated in seen), f"no retraction while decoding: {seen}"
    assert llm.engine.kv.num_used == 0 and not llm.engine.has_work
