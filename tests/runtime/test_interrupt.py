"""A step that raises (Ctrl-C, an error in the model or the sampler) is rolled back: stepping on
gives exactly the outputs of an uninterrupted run. An interrupted `generate` aborts its own
requests and leaves the LLM as good as new: the KV pool and request rows are free, nothing is
queued, and the next call gives what a fresh LLM gives. Prompts are chunked (small token budget)
and one waits for a free row, so interruptions land mid-prompt, mid-decode and, with overlap
scheduling, while a step launched ahead is in flight."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from compiled import LLM, SamplingParams
from compiled.demo import EXAMPLE_PROMPTS, MOE_MODEL
from compiled.runtime.engine import Engine
from compiled.runtime.request import RequestOutput
from compiled.runtime.scheduler import Batch

PROMPTS = EXAMPLE_PROMPTS[5:10]  # 6 to 21 tokens: chunked by the 8-token budget
SETTINGS = dict(device="cpu", dtype="float32", max_num_batched_tokens=8, max_num_seqs=4)


def _params() -> list[SamplingParams]:
    greedy = dict(temperature=0.0, ignore_eos=True)
    return [
        SamplingParams(max_new_tokens=10, **greedy),
        SamplingParams(max_new_tokens=8, temperature=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_new_tokens=10, logprobs=2, prompt_logprobs=2, **greedy),
        SamplingParams(max_new_tokens=6, temperature=1.0, top_k=8, seed=9, ignore_eos=True),
        SamplingParams(max_new_tokens=9, **greedy),
    ]


def _llm(overlap: bool) -> LLM:
    return LLM(MOE_MODEL, overlap_schedule=overlap, **SETTINGS)


@pytest.fixture(scope="module")
def fresh_outputs() -> dict[bool, list[RequestOutput]]:
    return {overlap: _llm(overlap).generate(PROMPTS, _params()) for overlap in (False, True)}


def _same(a: list[RequestOutput], b: list[RequestOutput]) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]
    assert [o.prompt_logprobs for o in a] == [o.prompt_logprobs for o in b]


def _mid_prompt(batch: Batch) -> bool:
    return any(0 < c.start < len(c.request.prompt_token_ids) for c in batch.chunks)


def _with_prompt_logprobs(batch: Batch) -> bool:
    return any(c.request.params.prompt_logprobs is not None for c in batch.chunks)


# Where the n-th call on a matching batch raises: the runner's forward on a batch continuing a
# prompt, on a decode batch (launched ahead of the previous step's read-back with overlap
# scheduling), or the sampler after a forward that computed prompt logprobs.
POINTS = {
    "prefill": ("forward", _mid_prompt, 2),
    "decode": ("forward", lambda batch: batch.is_decode, 3),
    "sampler": ("sampler", _with_prompt_logprobs, 1),
}


def _fail_on(engine: Engine, monkeypatch: pytest.MonkeyPatch, point: str,
             error: type[BaseException] = KeyboardInterrupt) -> Callable[[], int]:
    """Make the call at `point` raise `error` once; returns a counter of raises so far."""
    where, matches, n = POINTS[point]
    forward, sampler = engine.runner.forward, engine.sampler
    seen, raised, current = [0], [0], [None]

    def check(at: str) -> None:
        if at == where and matches(current[0]):
            seen[0] += 1
            if seen[0] == n:
                raised[0] += 1
                raise error("interrupted by the test")

    def failing_forward(batch, *args, **kwargs):
        current[0] = batch
        check("forward")
        return forward(batch, *args, **kwargs)

    def failing_sampler(*args, **kwargs):
        check("sampler")
        return sampler(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", failing_forward)
    monkeypatch.setattr(engine, "sampler", failing_sampler)
    return lambda: raised[0]


def _assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv.num_used == 0
    assert engine.req_pool.num_free == llm.config.max_num_seqs
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert not engine.has_work


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("point", list(POINTS))
def test_interrupted_generate_leaves_llm_as_new(point, overlap, fresh_outputs, monkeypatch):
    llm = _llm(overlap)
    raised = _fail_on(llm.engine, monkeypatch, point)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, _params())
    assert raised() == 1
    _assert_idle(llm)
    monkeypatch.undo()
    _same(llm.generate(PROMPTS, _params()), fresh_outputs[overlap])
    _assert_idle(llm)


def test_error_propagates_and_repeated_interrupts_leave_nothing(fresh_outputs, monkeypatch):
    llm = _llm(True)
    for point, error in [("decode", RuntimeError), ("prefill", KeyboardInterrupt), ("sampler", ValueError)]:
        _fail_on(llm.engine, monkeypatch, point, error)
        with pytest.raises(error, match="interrupted by the test"):
            llm.generate(PROMPTS, _params())
        monkeypatch.undo()
        _assert_idle(llm)
    _same(llm.generate(PROMPTS, _params()), fresh_outputs[True])


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("point", list(POINTS))
def test_failed_step_is_rolled_back(point, overlap, fresh_outputs, monkeypatch):
    """Driving the engine directly: the step that raised changed nothing, so stepping on gives
    exactly the uninterrupted outputs (seeded rows included: no randomness was drawn)."""
    llm = _llm(overlap)
    engine = llm.engine
    requests = [engine.make_request(i, p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, _params()))]
    for request in requests:
        engine.add(request)
    raised = _fail_on(engine, monkeypatch, point)
    finished = []
    while engine.has_work:
        try:
            finished += engine.step()
        except KeyboardInterrupt:
            pass
    assert raised() == 1
    assert sorted(r.id for r in finished) == sorted(r.id for r in requests)
    _same([r.to_output() for r in requests], fresh_outputs[overlap])
    _assert_idle(llm)
