"""GPU (bf16): multi-LoRA through compiled pieces and CUDA graphs (decode and piecewise) against
the same engine uncompiled, adapters on every target including the experts, mixed in one batch;
and no recompilation over 200 random batch / adapter mixes after warm-up."""

from __future__ import annotations

import random

import pytest

from compiled import LLM, SamplingParams
from compiled.compilation.inductor import COMPILES
from compiled.lora.random import random_adapter
from compiled.passes.variant import LORA
from tests.compilation.test_gpu_compile import assert_two_steps_close
from tests.conftest import reduced_real_config

pytestmark = pytest.mark.gpu
ADAPTERS = 5          # more than the slots: the pool swaps them in and out
SLOTS = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The Qwen3-30B-A3B shape with 4 layers, LoRA on, compiled + graphs and uncompiled."""
    folder = reduced_real_config(tmp_path_factory.mktemp("qwen3-30b-a3b-4l-lora"))
    common = dict(device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=1024, max_num_seqs=32,
                  max_num_batched_tokens=2048, kv_cache_tokens=16384, seed=3, enable_lora=True,
                  max_lora_rank=16, max_loras_per_batch=SLOTS)
    fast = LLM(folder, compile=True, cuda_graph_buckets=[1, 2, 4, 8, 16, 32], **common)
    plain = LLM(folder, compile=False, cuda_graph_buckets=[], **common)
    for llm in (fast, plain):
        for i in range(ADAPTERS):
            llm.add_lora(random_adapter(f"a{i}", llm.model_config, 16, seed=i))
    return fast, plain


def _mix(rng: random.Random, batch: int) -> list[str | None]:
    return [rng.choice([None] + [f"a{i}" for i in range(ADAPTERS)]) for _ in range(batch)]


def _run(llm: LLM, batch: int, seed: int, names: list[str | None]):
    rng = random.Random(seed)
    vocab = llm.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(5, 200))] for _ in range(batch)]
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True, logprobs=8)
    return llm.generate(prompts, params, lora=names)


@pytest.mark.parametrize("batch", [1, 3, 4, 8, 13, 32])
def test_lora_compiled_graphs_match_uncompiled(pair, batch):
    fast, plain = pair
    lora_graphs = fast.engine.runner.variants[LORA]
    assert lora_graphs.decode is not None and lora_graphs.piecewise is not None
    names = _mix(random.Random(batch), batch)
    names[0] = "a0"   # at least one adapter in the batch: the LoRA graphs run
    assert_two_steps_close(_run(fast, batch, batch, names), _run(plain, batch, batch, names), batch)


def test_adapters_change_the_output(pair):
    fast, _ = pair
    base = _run(fast, 4, 7, [None] * 4)
    lora = _run(fast, 4, 7, ["a1"] * 4)
    assert any(x.logprobs[0] != y.logprobs[0] for x, y in zip(base, lora))


def test_no_recompilation_over_random_mixes(pair):
    fast, _ = pair
    _run(fast, 5, 0, _mix(random.Random(0), 5))
    before = COMPILES["count"]
    rng = random.Random(1)
    for i in range(200):
        batch = rng.randint(1, 24)
        outs = _run(fast, batch, 1000 + i, _mix(rng, batch))
        assert len(outs) == batch
    assert COMPILES["count"] == before
