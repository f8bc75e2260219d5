"""Tensor parallelism on CPU (gloo, fp32): TP=2 gives the prompt logprobs (whole vocabulary) and
greedy tokens of TP=1 for one batch of prompts of odd lengths, on a dense model and on a MoE with a
dense layer among its MoE layers; TP=4 on a dense model whose K/V heads are replicated (2 of
them) and whose vocabulary does not divide by 4. Prefix-cache hits and chunked prefill ride along
(the 150-token prompt is prefilled in chunks; the repeated prompt starts from its cached prefix)."""

from __future__ import annotations

import pytest

from compiled import LLM, SamplingParams
from compiled.errors import ConfigError
from tests.conftest import assert_same_outputs, make_checkpoint

ENGINE = dict(max_num_batched_tokens=64, kv_cache_tokens=2048, max_model_len=256, enable_prefix_caching=True)
LENGTHS = (37, 3, 50, 150)
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=-1)


def _prompts(vocab: int) -> list[list[int]]:
    return [[(7 * i + 3 * n) % (vocab - 1) + 1 for i in range(n)] for n in LENGTHS]


def _run(model: str, world: int):
    llm = LLM(model, tensor_parallel_size=world, **ENGINE)
    try:
        prompts = _prompts(llm.model_config.vocab_size)
        first = llm.generate(prompts, PARAMS)
        again = llm.generate(prompts[2:3], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
        assert llm.engine.num_overlapped > 0   # decode steps whose input ids the workers got from the device
        assert llm.engine.scheduler.cache.hit >= 48   # the repeated prompt's cached K/V, pointed on every rank
    finally:
        llm.shutdown()
    return first, again


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {"dense": make_checkpoint(root / "dense", seed=1, num_hidden_layers=2, vocab_size=123),
            "mixed": make_checkpoint(root / "mixed", moe=True, seed=2, num_hidden_layers=3, mlp_only_layers=[1])}


@pytest.mark.parametrize("name, worlds", [("dense", (2, 4)), ("mixed", (2,))])
def test_tp_equals_tp_1(models, name, worlds, one_intra_op_thread):
    reference, ref_again = _run(models[name], 1)
    for world in worlds:
        outputs, again = _run(models[name], world)
        assert_same_outputs(outputs, reference)
        assert again[0].token_ids == ref_again[0].token_ids


def test_tp_refuses_what_it_cannot_split(models):
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        LLM(models["dense"], tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ConfigError, match="merge_lora=True: expected False with tensor_parallel_size > 1"):
        LLM(models["dense"], tensor_parallel_size=2, merge_lora=True, **ENGINE)


def test_tp_with_a_batch_mixing_lora_adapters_and_base_rows(one_intra_op_thread):
    """The demo MoE model's adapters (attention, MLP and expert targets) and base rows in one
    batch: TP=2 (column-parallel B and row-parallel A sharded per rank) gives TP=1's outputs."""
    from compiled.demo import MOE_ADAPTERS
    adapters = [None, "upper", "first", "upper"]

    def run(world: int, *loras: list[str | None]):
        llm = LLM(None, tensor_parallel_size=world, lora_modules=dict(MOE_ADAPTERS), **ENGINE)
        try:
            projections = {name: llm.engine.loras.adapters[name].projections for name in MOE_ADAPTERS}
            return [llm.generate(_prompts(llm.model_config.vocab_size), PARAMS, lora=a) for a in loras], projections
        finally:
            llm.shutdown()
    (reference,), projections = run(1, adapters)
    assert {"q_proj", "o_proj"} <= projections["first"] and {"gate_proj", "down_proj"} <= projections["upper"]
    (outputs, base), _ = run(2, adapters, [None] * len(adapters))
    assert_same_outputs(outputs, reference)
    for b, r, a in zip(base, reference, adapters):   # the adapters change their rows' logprobs
        gap = max(abs(x[k] - y[k]) for x, y in zip(b.prompt_logprobs[1:], r.prompt_logprobs[1:]) for k in x)
        assert (gap > 1e-2) == (a is not None)


def test_a_rank_killed_mid_generate_ends_it_with_a_one_line_error(models, monkeypatch):
    import os
    import signal
    import time

    from compiled.parallel.group import CPError
    from compiled.runtime.model_runner import ModelRunner
    llm = LLM(models["dense"], tensor_parallel_size=2, cp_timeout=5.0, **ENGINE)
    worker = llm.engine.runner.tp.processes[0]
    forward, steps = ModelRunner._forward, []

    def kill_after_two(self, *args):
        steps.append(1)
        if len(steps) == 3:
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(10)
        return forward(self, *args)

    monkeypatch.setattr(ModelRunner, "_forward", kill_after_two)
    start = time.monotonic()
    try:
        with pytest.raises(CPError) as e:
            llm.generate([list(range(1, 40))], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        assert time.monotonic() - start < 60
        assert "\n" not in str(e.value) and "tensor-parallel group of 2" in str(e.value)
        assert worker.exitcode is not None
        with pytest.raises(CPError):   # no rank can run without the others' shards
            llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1))
    finally:
        llm.shutdown()


TORCHRUN_SCRIPT = """
import json
from compiled import LLM, SamplingParams
llm = LLM(None, tensor_parallel_size=2, **{engine!r})
out = llm.generate([{prompt!r}], SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
print("RESULT " + json.dumps({{"tokens": out[0].token_ids, "world": llm.engine.runner.tp.world}}))
llm.shutdown()
"""


def test_torchrun_ranks_join_the_tensor_parallel_group(tmp_path):
    from tests.conftest import torchrun_result
    prompt = list(range(3, 40))
    result = torchrun_result(tmp_path, TORCHRUN_SCRIPT.format(engine=ENGINE, prompt=prompt))
    llm = LLM(None, **ENGINE)
    ref = llm.generate([prompt], SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert result["world"] == 2 and result["tokens"] == ref.token_ids
