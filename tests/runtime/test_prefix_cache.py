"""The radix prefix cache: the tree itself (match, split, lock, LRU eviction, drop), and an engine
with it giving exactly the outputs of one without it: greedy and seeded, a shared-prefix batch,
under retraction and eviction, and with adapters (a prompt under two adapters shares nothing)."""

from __future__ import annotations

import random

import numpy as np
import torch

from compiled import LLM, SamplingParams
from compiled.attention.kv_cache import KVPool
from compiled.demo import MOE_ADAPTERS
from compiled.runtime.prefix_cache import PrefixCache


def _pool(n: int = 64) -> KVPool:
    return KVPool(1, n, 1, 4, torch.float32, torch.device("cpu"))


def test_match_split_lock_evict_and_drop():
    kv = _pool()
    cache = PrefixCache(kv)
    a = kv.alloc(6)
    assert len(cache.insert(None, [1, 2, 3, 4, 5, 6], a, None)) == 0 and cache.num_cached == 6
    b = kv.alloc(5)
    dup = cache.insert(None, [1, 2, 3, 9, 9], b, None)          # splits after [1, 2, 3]
    assert list(dup) == list(b[:3]) and cache.num_cached == 8     # its first three are duplicates
    kv.free(dup)
    p = cache.match(None, [1, 2, 3, 4, 7])
    assert list(p.slots) == list(a[:4]) and cache.num_locked == 4
    assert cache.match("other", [1, 2, 3]) is None                # another adapter's tree
    free_before = kv.num_free
    cache.evict(100)                                              # everything not locked
    assert cache.num_cached == 4 and kv.num_free == free_before + 4
    cache.release(p)
    assert cache.num_evictable == 4
    cache.drop(None)
    assert cache.num_cached == 0 and kv.num_free == 64


def test_eviction_takes_least_recently_used_leaves_first():
    kv = _pool()
    cache = PrefixCache(kv)
    for first in (10, 20, 30):
        cache.insert(None, [first, 1, 2], kv.alloc(3), None)
    cache.release(cache.match(None, [10, 1, 2]))                  # 10 used last
    cache.evict(3)
    assert cache.match(None, [20, 1]) is None and cache.match(None, [10, 1]) is not None


PARAMS = [SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
          SamplingParams(max_new_tokens=8, temperature=0.9, seed=3, ignore_eos=True)]


def _workload(vocab: int, n: int = 12) -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(1, vocab) for _ in range(40)]
    return [system + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 9))] for _ in range(n)]


def _run(prompts, waves: int = 2, lora=None, **kwargs):
    llm = LLM(None, **kwargs)
    outs = []
    for _ in range(waves):   # the second wave finds the first's K/V cached
        for params in PARAMS:
            outs.append([o.token_ids for o in llm.generate(prompts, params, lora=lora)])
    return outs, llm


def test_outputs_equal_without_the_cache_and_prefixes_are_reused():
    prompts = _workload(200)
    ref, _ = _run(prompts)
    outs, llm = _run(prompts, enable_prefix_caching=True)
    assert outs == ref
    cache = llm.engine.scheduler.cache
    assert cache.hit > 0.5 * cache.queried          # the shared system prompt and the repeated waves
    assert llm.engine.kv.num_used == cache.num_cached and cache.num_locked == 0


def test_outputs_equal_under_retraction_and_eviction():
    prompts = _workload(200, n=16)
    small = dict(kv_cache_tokens=180, max_model_len=128, max_num_batched_tokens=48)
    ref, _ = _run(prompts, **small)
    outs, llm = _run(prompts, enable_prefix_caching=True, **small)
    assert outs == ref
    assert llm.engine.scheduler.num_retractions > 0 and llm.engine.scheduler.cache.hit > 0


def test_a_prompt_under_two_adapters_shares_nothing():
    prompts = _workload(200, n=4)
    lora = dict(lora_modules={"upper": MOE_ADAPTERS["upper"], "first": MOE_ADAPTERS["first"]})
    llm = LLM(None, enable_prefix_caching=True, **lora)
    greedy = PARAMS[0]
    upper = [o.token_ids for o in llm.generate(prompts, greedy, lora="upper")]
    cache = llm.engine.scheduler.cache
    hit = cache.hit
    first = [o.token_ids for o in llm.generate(prompts[:1], greedy, lora="first")]
    assert cache.hit == hit                          # nothing of "upper"'s tree is reused
    ref = LLM(None, **lora)
    assert upper == [o.token_ids for o in ref.generate(prompts, greedy, lora="upper")]
    assert first == [o.token_ids for o in ref.generate(prompts[:1], greedy, lora="first")]
    llm.unload_lora("upper")                         # its cached prefixes go with it
    assert "upper" not in cache.roots and np.all(llm.engine.kv.num_used == cache.num_cached)


def test_running_requests_share_their_prompt():
    """The n choices of one prompt (and any request with the same start) reuse the prompt's K/V
    while the first is still decoding: it is prefilled once."""
    prompt = _workload(200, n=1)[0] * 2
    params = [SamplingParams(max_new_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in range(4)]
    ref = LLM(None).generate([prompt] * 4, params)
    llm = LLM(None, enable_prefix_caching=True)
    out = llm.generate([prompt] * 4, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    cache = llm.engine.scheduler.cache
    assert cache.hit == 3 * (len(prompt) - 1)      # choices 2-4 found all but the last prompt token cached
    assert llm.engine.kv.num_used == cache.num_cached and cache.num_locked == 0
