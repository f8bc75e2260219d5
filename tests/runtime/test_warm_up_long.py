"""Start-up runs the step sizes past the largest piecewise bucket once (they run unpadded, without
graphs), so that their kernels are compiled before a request waits on them; the padding-only
batches leave no trace in what requests compute."""

from __future__ import annotations

from types import SimpleNamespace

from compiled import LLM, SamplingParams
from compiled.demo import MOE_MODEL
from compiled.runtime.engine import Engine


def _sizes(largest_bucket: int, budget: int) -> list[int]:
    stub = SimpleNamespace(cfg=SimpleNamespace(max_num_batched_tokens=budget),
                           piecewise_buckets=lambda: [16, largest_bucket])
    return Engine.unbucketed_sizes(stub)


def test_sizes_cover_both_specialisations_near_the_bucket_and_at_the_budget():
    assert _sizes(2048, 8192) == [2049, 2064, 8191, 8192]
    assert _sizes(2048, 2050) == [2049, 2050]
    assert _sizes(2048, 2048) == []


def test_padding_only_warm_up_leaves_outputs_unchanged():
    prompts = [list(range(5, 60)), [7, 3, 9]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    engine = dict(device="cpu", dtype="float32", max_model_len=96, max_num_batched_tokens=80)
    llm = LLM(MOE_MODEL, **engine)
    before = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.runner.warm_up([65, 80]) >= 0
    assert [o.token_ids for o in llm.generate(prompts, params)] == before
    assert llm.engine.kv.num_used == 0
