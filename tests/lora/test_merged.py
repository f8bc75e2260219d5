"""`merge_lora`: an adapter folded into the dense weights while it is the only one running gives the
unmerged engine's outputs (CPU, fp32), unmerges bit for bit for any other batch, never folds an
adapter with expert weights, and follows an adapter loaded again under the same name."""

from __future__ import annotations

import pytest
import torch

from compiled import LLM, SamplingParams
from compiled.demo import DENSE_ADAPTERS, DENSE_MODEL, MOE_ADAPTERS, MOE_MODEL
from compiled.errors import ConfigError
from compiled.lora import merged as merged_mod

GREEDY = SamplingParams(max_new_tokens=2 * merged_mod.MERGE_AFTER_STEPS, temperature=0.0, ignore_eos=True,
                        logprobs=0)


def _llm(model, adapters, merge):
    return LLM(model, device="cpu", dtype="float32", lora_modules=dict(adapters), max_lora_rank=16,
               merge_lora=merge)


def _run(llm, prompts, loras):
    return llm.generate([llm.tokenizer.encode(p) for p in prompts], GREEDY, lora=loras)


def _same(got, want):
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        chosen = [[step[t] for step, t in zip(out.logprobs, out.token_ids)] for out in (g, w)]
        torch.testing.assert_close(torch.tensor(chosen[0]), torch.tensor(chosen[1]), atol=1e-4, rtol=0)


def _same_weights(llm, plain):
    theirs = dict(plain.model.named_parameters())
    return all(torch.equal(w, theirs[name]) for name, w in llm.model.named_parameters())


@pytest.fixture(scope="module")
def dense():
    return _llm(DENSE_MODEL, DENSE_ADAPTERS, True), _llm(DENSE_MODEL, DENSE_ADAPTERS, False)


def test_one_adapter_merges_and_gives_the_unmerged_outputs(dense):
    llm, plain = dense
    m = llm.engine.runner.merged
    prompts = ["copy Bird wax:", "count 95:"]
    for name in ("upper", "first"):
        before = m.merges
        _same(_run(llm, prompts, [name, name]), _run(plain, prompts, [name, name]))
        assert m.merges == before + 1 and m.merged is not None, name   # the second adapter replaced the first


def test_another_batch_unmerges_bit_for_bit(dense):
    llm, plain = dense
    m = llm.engine.runner.merged
    _run(llm, ["count 7:"], ["upper"])
    assert m.merged is not None
    prompts, loras = ["count 7:", "copy hi:", "COPY jam:"], [None, "upper", "first"]
    _same(_run(llm, prompts, loras), _run(plain, prompts, loras))
    assert m.merged is None and _same_weights(llm, plain)
    _run(llm, ["count 7:"], ["first"])
    assert not _same_weights(llm, plain)
    _same(_run(llm, ["count 7:"], [None]), _run(plain, ["count 7:"], [None]))   # base rows alone: unmerged
    assert m.merged is None and _same_weights(llm, plain)


def test_an_adapter_loaded_again_under_its_name_is_merged_afresh(dense):
    llm, plain = dense
    m = llm.engine.runner.merged
    _run(llm, ["count 7:"], ["upper"])
    assert m.merged is not None
    llm.unload_lora("upper")
    llm.load_lora("upper", DENSE_ADAPTERS["first"])   # same name and slot, other weights
    try:
        _same(_run(llm, ["copy Bird wax:"], ["upper"]), _run(plain, ["copy Bird wax:"], ["first"]))
    finally:
        llm.unload_lora("upper")
        llm.load_lora("upper", DENSE_ADAPTERS["upper"])


def test_expert_adapters_stay_unmerged_on_a_moe_model():
    llm = _llm(MOE_MODEL, MOE_ADAPTERS, True)
    m = llm.engine.runner.merged
    _run(llm, ["copy Bird wax:"], ["upper"])   # gate/up/down of the experts: never merged
    assert m.merges == 0 and m.merged is None
    _same(_run(llm, ["copy Bird wax:"], ["first"]), _run(_llm(MOE_MODEL, MOE_ADAPTERS, False), ["copy Bird wax:"],
                                                         ["first"]))
    assert m.merges == 1   # attention only: its expert deltas are zero


def test_merge_lora_with_context_parallelism_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"^merge_lora=True: expected False with context_parallel_size > 1"):
        LLM(DENSE_MODEL, device="cpu", enable_lora=True, merge_lora=True, context_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_merged_adapter_in_the_base_cuda_graphs():
    """bf16, compiled, CUDA graphs: the merged steps replay the base graphs and give the tokens
    of the unmerged deltas (each engine against the other: the demo model is confident)."""
    llms = [LLM(DENSE_MODEL, lora_modules=dict(DENSE_ADAPTERS), max_lora_rank=16, merge_lora=merge)
            for merge in (True, False)]
    prompts = ["copy Bird wax:", "count 95:", "COPY jam:"]
    for name in ("upper", "first"):
        got, want = (_run(llm, prompts, [name] * 3) for llm in llms)
        assert [g.token_ids for g in got] == [w.token_ids for w in want], name
    m = llms[0].engine.runner.merged
    assert m.merges == 2
    _run(llms[0], prompts, [None, "upper", "first"])
    assert m.merged is None
