"""The tensor-parallel graph at a world of one rank: `tp_shard` for rank 0 of 1 (whole shards, an
all-reduce after every row-parallel output and the embedding, the vocab-parallel LM head), run by
the engine with its CUDA graphs on a GPU, gives the greedy tokens and prompt logprobs of the
engine that never shards. A world of one normally skips the pass (`passes_for`); forcing it here
checks that the collectives, the head and the fused ops it feeds are the identity they claim."""

from __future__ import annotations

import pytest
import torch

from compiled import LLM, SamplingParams
from compiled.passes import manager
from compiled.passes.tp_shard import tp_shard_pass
from compiled.runtime import build

PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=5)
PROMPTS = [[(5 * i + 3 * n) % 97 + 1 for i in range(n)] for n in (29, 4, 61)]


def _with_tp_shard_at_world_one(variant, *rest):
    passes = manager.passes_for(variant, *rest)
    return [tp_shard_pass(1, 0), *passes] if variant.tp_size == 1 else passes


def _generate(model: str, **engine):
    llm = LLM(model, max_model_len=256, **engine)
    try:
        outs = llm.generate(PROMPTS, PARAMS)
        rewrites = {r.name: r.rewrites for r in llm.build_report.records}
    finally:
        llm.shutdown()
    return outs, rewrites


def _compare(model: str, monkeypatch, tol: float, **engine):
    plain, rewrites = _generate(model, **engine)
    assert "tp_shard" not in rewrites
    monkeypatch.setattr(build, "passes_for", _with_tp_shard_at_world_one)
    sharded, rewrites = _generate(model, **engine)
    assert rewrites["tp_shard"] > 0
    for a, b in zip(plain, sharded):
        assert a.token_ids == b.token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            top = max(pa, key=pa.get)
            assert top in pb and abs(pa[top] - pb[top]) <= tol


def test_world_of_one_through_tp_shard_on_cpu(monkeypatch):
    from compiled.demo import MOE_MODEL
    _compare(str(MOE_MODEL), monkeypatch, 1e-4, dtype="float32")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_world_of_one_through_tp_shard_on_gpu(monkeypatch):
    from compiled.demo import MOE_MODEL
    _compare(str(MOE_MODEL), monkeypatch, 2e-2, device="cuda", dtype="bfloat16")
