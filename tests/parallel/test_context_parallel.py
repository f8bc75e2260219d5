"""Context-parallel prefill on CPU (gloo, fp32): CP=2 and CP=3 give the prompt logprobs (whole
vocabulary) and greedy tokens of CP=1, for one batch of prompts of odd lengths (one shorter than
two tokens a rank), a prompt prefilled in chunks over its cached prefix, and with a LoRA adapter."""

from __future__ import annotations

import pytest

from compiled import LLM, SamplingParams
from compiled.demo import MOE_ADAPTERS
from tests.conftest import assert_same_outputs, make_checkpoint

# 64-token steps: the 150-token prompt is prefilled in three chunks, each over the ones before it.
ENGINE = dict(max_num_batched_tokens=64, cp_min_tokens=8, kv_cache_tokens=2048, max_model_len=256)
LENGTHS = (37, 3, 50, 150)
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=-1)


def _prompts(vocab: int) -> list[list[int]]:
    return [[(7 * i + 3 * n) % (vocab - 1) + 1 for i in range(n)] for n in LENGTHS]


def _run(model: str | None, world: int, lora: str | None = None, **extra):
    kwargs = dict(ENGINE, **extra)
    if world > 1:
        kwargs["context_parallel_size"] = world
    llm = LLM(model, **kwargs)
    try:
        outputs = llm.generate(_prompts(llm.model_config.vocab_size), PARAMS, lora=lora)
        cp = llm.engine.runner.cp
        steps = (cp.steps, cp.split_tokens) if cp is not None else (0, 0)
    finally:
        llm.shutdown()
    return outputs, steps


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    return {"demo-moe": None,
            "dense": make_checkpoint(root / "dense", seed=1, num_hidden_layers=3),
            "mixed": make_checkpoint(root / "mixed", moe=True, seed=2, num_hidden_layers=3, mlp_only_layers=[1])}


@pytest.mark.parametrize("name", ["demo-moe", "dense", "mixed"])
def test_cp_2_and_3_equal_cp_1(models, name):
    reference, _ = _run(models[name], 1)
    for world in (2, 3):
        outputs, (steps, split_tokens) = _run(models[name], world)
        assert_same_outputs(outputs, reference)
        # 37 + 50 + the 150-token prompt's three chunks split; the 3-token prompt does not
        assert steps >= 2 and split_tokens == 37 + 50 + 150


def test_cp_with_a_lora_adapter():
    lora = dict(lora_modules={"upper": MOE_ADAPTERS["upper"]})
    reference, _ = _run(None, 1, lora="upper", **lora)
    outputs, (steps, _) = _run(None, 2, lora="upper", **lora)
    assert steps >= 2
    assert_same_outputs(outputs, reference)
    base, _ = _run(None, 1)
    assert [o.token_ids for o in base] != [o.token_ids for o in reference]   # the adapter changes the output


TORCHRUN_SCRIPT = """
import json
from compiled import LLM, SamplingParams
llm = LLM(None, context_parallel_size=2, **{engine!r})
out = llm.generate([{prompt!r}], SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
print("RESULT " + json.dumps({{"tokens": out[0].token_ids, "steps": llm.engine.runner.cp.steps}}))
llm.shutdown()
"""


def test_torchrun_ranks_join_the_group(tmp_path):
    from tests.conftest import torchrun_result
    prompt = list(range(3, 90))
    result = torchrun_result(tmp_path, TORCHRUN_SCRIPT.format(engine=ENGINE, prompt=prompt))
    llm = LLM(None, **ENGINE)
    ref = llm.generate([prompt], SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert result["steps"] >= 2 and result["tokens"] == ref.token_ids
