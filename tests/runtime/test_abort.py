"""`Engine.abort` ends a request wherever it is (waiting, part-way through its prompt, decoding,
with a step launched ahead computing its next token): its KV slots and row are freed at once,
`step` never returns it, and the requests beside it finish exactly as when run alone."""

from __future__ import annotations

import pytest

from compiled import LLM, SamplingParams
from compiled.demo import EXAMPLE_PROMPTS, MOE_MODEL
from compiled.runtime.engine import Engine
from compiled.runtime.request import Request

SETTINGS = dict(device="cpu", dtype="float32", max_num_batched_tokens=8, max_num_seqs=3)
GREEDY = dict(temperature=0.0, ignore_eos=True)

# name: (prompt, params); added in this order, so the last two wait for a free row.
REQUESTS = {
    "decoding": (EXAMPLE_PROMPTS[5], SamplingParams(max_new_tokens=24, **GREEDY)),
    "prefilling": (EXAMPLE_PROMPTS[11], SamplingParams(max_new_tokens=8, **GREEDY)),
    "kept": (EXAMPLE_PROMPTS[3], SamplingParams(max_new_tokens=12, logprobs=1, **GREEDY)),
    "waiting": (EXAMPLE_PROMPTS[0], SamplingParams(max_new_tokens=8, **GREEDY)),
    "kept_seeded": (EXAMPLE_PROMPTS[6], SamplingParams(max_new_tokens=10, temperature=0.8, seed=3)),
}
KEPT = ("kept", "kept_seeded")


def _llm(overlap: bool) -> LLM:
    return LLM(MOE_MODEL, overlap_schedule=overlap, **SETTINGS)


def _due(name: str, request: Request, engine: Engine) -> bool:
    """Whether `request` is at the point where the test aborts it."""
    if name == "waiting":
        return any(r is request for r in engine.scheduler.waiting)
    if name == "prefilling":
        return 0 < request.num_computed < len(request.prompt_token_ids)
    if name == "decoding":  # with overlap scheduling: while a step computing its next token runs
        return len(request.output_token_ids) >= 4 and (request.pending == 1 or not engine.overlap_schedule)
    return False


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_abort_anywhere_leaves_the_others_as_run_alone(overlap):
    llm = _llm(overlap)
    engine = llm.engine
    requests = {name: engine.make_request(i, p, sp) for i, (name, (p, sp)) in enumerate(REQUESTS.items())}
    for request in requests.values():
        engine.add(request)
    to_abort = {name: r for name, r in requests.items() if name not in KEPT}
    returned = []
    while engine.has_work:
        returned += engine.step()
        for name, request in list(to_abort.items()):
            if _due(name, request, engine):
                used, free_rows = engine.kv.num_used, engine.req_pool.num_free
                held = sum(len(slots) for slots in request.slots)
                assert (held > 0) == (name != "waiting")
                assert engine.abort(request.id)
                assert engine.kv.num_used == used - held
                assert engine.req_pool.num_free == free_rows + (name != "waiting")
                del to_abort[name]
    assert not to_abort, f"never reached the point to abort {sorted(to_abort)}"
    assert sorted(r.id for r in returned) == sorted(requests[n].id for n in KEPT)
    for name, request in requests.items():
        assert (request.finish_reason == "abort") == (name not in KEPT)
        assert not engine.abort(request.id)
    assert engine.kv.num_used == 0 and engine.req_pool.num_free == SETTINGS["max_num_seqs"]

    alone = _llm(overlap)
    for name in KEPT:
        prompt, params = REQUESTS[name]
        solo = alone.generate([prompt], params)[0]
        got = requests[name].to_output()
        assert got.token_ids == solo.token_ids and got.text == solo.text
        assert got.finish_reason == solo.finish_reason
        if solo.logprobs is not None:
            assert [sorted(e) for e in got.logprobs] == [sorted(e) for e in solo.logprobs]
            assert _values(got.logprobs) == pytest.approx(_values(solo.logprobs), abs=1e-4)


def _values(entries: list[dict[int, float]]) -> list[float]:
    return [entry[token] for entry in entries for token in sorted(entry)]


def test_abort_unknown_or_finished_request_is_false():
    llm = _llm(False)
    out = llm.generate([EXAMPLE_PROMPTS[0]], SamplingParams(max_new_tokens=2, **GREEDY))[0]
    assert not llm.engine.abort(out.request_id)
    assert not llm.engine.abort(10_000)
