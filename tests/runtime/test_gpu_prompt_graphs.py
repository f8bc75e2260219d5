"""GPU: a lone prompt's prefill replayed as one CUDA graph (`runtime/prompt_graphs.py`) against the
same engine without those graphs (piecewise graphs, attention launched between them) and against
the uncompiled model: prompts that fill their token bucket and prompts padded to it, a chunk after
a cached prefix, prompt logprobs, and a prefix too long for the graphs' tiles (piecewise then)."""

from __future__ import annotations

import contextlib
import random

import pytest

from compiled import LLM, SamplingParams
from compiled.passes.variant import BASE
from compiled.runtime.prompt_graphs import MAX_PREFIX
from tests.compilation.test_gpu_compile import assert_two_steps_close
from tests.conftest import reduced_real_config

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=8)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = reduced_real_config(tmp_path_factory.mktemp("qwen3-30b-a3b-4l"))
    common = dict(device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=4096, max_num_seqs=8,
                  max_num_batched_tokens=2048, kv_cache_tokens=32768, seed=5, enable_prefix_caching=True)
    return LLM(model, compile=True, cuda_graph_buckets=[1, 2, 4, 8], **common), \
        LLM(model, compile=False, cuda_graph_buckets=[], **common)


@contextlib.contextmanager
def without_prompt_graphs(llm: LLM):
    entry = llm.engine.runner.variants[BASE]
    graphs, entry.prompt = entry.prompt, None
    try:
        yield
    finally:
        entry.prompt = graphs


def uncached(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    """`generate` with the prefix cache emptied first: every prompt computed from its first token."""
    llm.engine.scheduler.cache.drop(None)
    return llm.generate(prompts, params)


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("length", [2, 7, 16, 100, 512, 1500, 2048])
def test_prompt_graph_matches_piecewise_and_uncompiled(engines, length):
    fast, plain = engines
    graphs = fast.engine.runner.variants[BASE].prompt
    prompt = _prompt(length, length, fast.model_config.vocab_size)
    before = graphs.replays
    got = uncached(fast, [prompt], GREEDY)
    assert graphs.replays == before + 1
    with without_prompt_graphs(fast):
        piecewise = uncached(fast, [prompt], GREEDY)
    # The same kernels over the same inputs, launched another way.
    assert got[0].token_ids == piecewise[0].token_ids
    for mine, theirs in zip(got[0].logprobs, piecewise[0].logprobs):
        assert mine.keys() == theirs.keys()
        assert max(abs(mine[t] - theirs[t]) for t in theirs) < 1e-3
    assert_two_steps_close(got, plain.generate([prompt], GREEDY), 1)


def test_chunk_after_cached_prefix(engines):
    """The second prompt shares the first's opening tokens: its chunk starts past them (the
    graph's requests read their prefix from the pools), or, past MAX_PREFIX, runs piecewise."""
    fast, plain = engines
    graphs = fast.engine.runner.variants[BASE].prompt
    vocab = fast.model_config.vocab_size
    for shared, seed in ((300, 1), (MAX_PREFIX + 400, 2)):
        first = _prompt(seed, shared + 37, vocab)
        second = first[:shared] + _prompt(seed + 10, 150, vocab)
        fast.generate([first], GREEDY)
        before = graphs.replays
        got = fast.generate([second], GREEDY)
        assert got[0].num_cached_tokens > 0
        assert (graphs.replays == before + 1) == (got[0].num_cached_tokens <= MAX_PREFIX)
        assert_two_steps_close(got, plain.generate([second], GREEDY), 1)


def test_prompt_logprobs_from_the_graphs_hidden_states(engines):
    fast, _ = engines
    prompt = _prompt(9, 300, fast.model_config.vocab_size)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    graphs = fast.engine.runner.variants[BASE].prompt
    before = graphs.replays
    got = uncached(fast, [prompt], params)[0].prompt_logprobs
    assert graphs.replays == before + 1
    with without_prompt_graphs(fast):
        want = uncached(fast, [prompt], params)[0].prompt_logprobs
    assert len(got) == len(want) == len(prompt)
    for i in range(1, len(prompt)):   # each position's own token is always among its logprobs
        assert abs(got[i][prompt[i]] - want[i][prompt[i]]) < 1e-3


def test_greedy_runs_equal_with_and_without(engines):
    """Prompts one after another (each alone, then decoding): the same tokens either way."""
    fast, _ = engines
    vocab = fast.model_config.vocab_size
    prompts = [_prompt(50 + i, n, vocab) for i, n in enumerate((33, 64, 129, 700))]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    got = [uncached(fast, [p], params)[0].token_ids for p in prompts]
    with without_prompt_graphs(fast):
        want = [uncached(fast, [p], params)[0].token_ids for p in prompts]
    assert got == want
