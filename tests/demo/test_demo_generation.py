"""Greedy generation on the trained demo models: batched == alone == HF generate, token for token;
the same under queueing, chunked prefill and KV-exhaustion retraction; seeded sampling alone ==
in a batch; stop strings."""

from __future__ import annotations

import pytest
import torch

from compiled import LLM, SamplingParams
from compiled.demo import DENSE_MODEL, EXAMPLE_PROMPTS, MOE_MODEL

MODELS = {"moe": MOE_MODEL, "dense": DENSE_MODEL}
GREEDY = SamplingParams(max_new_tokens=64, temperature=0.0)


@pytest.fixture(scope="module", params=list(MODELS))
def demo(request):
    return MODELS[request.param], LLM(MODELS[request.param], device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def batched(demo):
    return demo[1].generate(EXAMPLE_PROMPTS, GREEDY)


def _hf_greedy(path: str, prompt_ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_prompts_differ_in_length(demo):
    lengths = {len(demo[1].tokenizer.encode(p)) for p in EXAMPLE_PROMPTS}
    assert len(EXAMPLE_PROMPTS) >= 8 and len(lengths) >= 6


def test_batch_equals_hf_generate(demo, batched):
    path, _ = demo
    for out in batched:
        assert out.token_ids == _hf_greedy(path, out.prompt_token_ids, 64), out.prompt


def test_batch_equals_alone(demo, batched):
    llm = demo[1]
    for prompt, out in zip(EXAMPLE_PROMPTS, batched):
        alone = llm.generate([prompt], GREEDY)[0]
        assert alone.token_ids == out.token_ids and alone.text == out.text


def test_padded_to_token_buckets(demo, batched):
    """Prefill and mixed steps padded to token buckets (what the piecewise CUDA graphs replay):
    the padding request changes no token and no prompt logprob."""
    path, llm = demo
    padded = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=64)
    padded.engine.runner.prefill_buckets = [16, 32, 64]
    params = SamplingParams(max_new_tokens=64, temperature=0.0, prompt_logprobs=0)
    outs = padded.generate(EXAMPLE_PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in batched]
    plain = llm.generate(EXAMPLE_PROMPTS[:3], params)
    for a, b in zip(outs, plain):
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-5 for t in x)


def test_batch_equals_under_pressure(demo, batched):
    """Few sequences, a tiny step budget and a KV cache too small for all: requests queue, prefill
    in chunks, get retracted and resume, and still produce the same tokens."""
    path, _ = demo
    longest = max(len(o.prompt_token_ids) + len(o.token_ids) for o in batched)
    tight = LLM(path, device="cpu", dtype="float32", max_num_seqs=3, max_num_batched_tokens=16,
                kv_cache_tokens=longest + 24, max_model_len=longest + 24)
    outs = tight.generate(EXAMPLE_PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in batched]
    assert tight.engine.scheduler.num_retractions > 0
    assert tight.engine.kv.num_used == 0  # everything freed on finish


def test_seeded_sampling_alone_equals_in_batch(demo):
    llm = demo[1]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95, seed=1234)
    alone = llm.generate([EXAMPLE_PROMPTS[2]], params)[0]
    mixed = [SamplingParams(max_new_tokens=10, temperature=0.7), params,
             SamplingParams(max_new_tokens=5, temperature=0.0), SamplingParams(max_new_tokens=30, seed=9, top_k=5)]
    outs = llm.generate([EXAMPLE_PROMPTS[0], EXAMPLE_PROMPTS[2], EXAMPLE_PROMPTS[4], EXAMPLE_PROMPTS[6]], mixed)
    assert outs[1].token_ids == alone.token_ids


def test_stop_string_ends_and_is_excluded(demo, batched):
    llm = demo[1]
    full = batched[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate([EXAMPLE_PROMPTS[0]], SamplingParams(max_new_tokens=64, temperature=0.0, stop=[stop]))[0]
    cut = full.text.index(stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:cut]
    kept = llm.generate([EXAMPLE_PROMPTS[0]], SamplingParams(max_new_tokens=64, temperature=0.0, stop=[stop],
                                                             include_stop_str_in_output=True))[0]
    assert kept.text == full.text[:cut + len(stop)]


def test_logprobs_of_generated_tokens(demo):
    llm = demo[1]
    out = llm.generate([EXAMPLE_PROMPTS[1]], SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) in (3, 4)
        assert entry[token] == max(entry.values())  # greedy picks the top token


def test_prompt_logprobs_match_hf(demo):
    """Done-when 1 on the trained demo models: every prompt position within 1e-4 of HF."""
    from compiled.demo import EXAMPLE_PROMPTS as prompts
    from tests.conftest import hf_model
    from tests.graphs.test_hf_parity import assert_prompt_logprobs_match
    path, llm = demo
    hf = hf_model(path)
    outs = llm.generate(prompts[:4], SamplingParams(max_new_tokens=1, prompt_logprobs=-1))
    for out in outs:
        with torch.no_grad():
            logits = hf(torch.tensor([out.prompt_token_ids])).logits[0].float()
        assert_prompt_logprobs_match(out, torch.log_softmax(logits, -1))


def test_startup_heap_frozen_and_released():
    # start-up freezes what it built out of the collector's reach (no full collection walks it
    # mid-step); release_frozen_heap() gives it back, and a dropped LLM is then freed
    import gc
    import weakref

    from compiled.runtime.llm import release_frozen_heap
    release_frozen_heap()
    llm = LLM(DENSE_MODEL, device="cpu", dtype="float32")
    assert gc.get_freeze_count() > 0 and "gc_freeze" in llm.startup_seconds
    model = weakref.ref(llm.model)
    del llm
    gc.collect()
    assert model() is not None, "frozen: a plain collection leaves it"
    release_frozen_heap()
    assert model() is None and gc.get_freeze_count() == 0
