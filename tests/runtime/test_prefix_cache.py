"""The radix prefix cache: the tree itself (match, split, lock, LRU eviction, drop), and an engine
with it giving exactly the outputs of one without it: greedy and seeded, a shared-prefix batch,
under retraction and eviction, and with adapters (a prompt under two adapters shares nothing)."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest
import torch

from compiled import LLM, SamplingParams
from compiled.attention.kv_cache import KVPool
from compiled.demo import MOE_ADAPTERS
from compiled.runtime.prefix_cache import Node, PrefixCache


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


class _ScanEvictCache(PrefixCache):
    """The oracle: eviction by a scan of the whole tree for unlocked leaves on every call."""

    def evict(self, n: int) -> None:
        leaves = [(x.last_used, id(x), x) for x in _tree(self) if not x.children and x.refs == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < n and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            self.kv.free(leaf.slots)
            self.num_cached -= len(leaf.slots)
            freed += len(leaf.slots)
            if parent.parent is not None and not parent.children and parent.refs == 0:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))


def _tree(cache: PrefixCache) -> list[Node]:
    stack = [c for root in cache.roots.values() for c in root.children.values()]
    nodes = []
    while stack:
        nodes.append(stack.pop())
        stack += nodes[-1].children.values()
    return nodes


def _snapshot(node: Node) -> tuple:
    return (node.tokens, tuple(node.slots), node.refs, node.last_used,
            tuple(_snapshot(node.children[t]) for t in sorted(node.children)))


def _drive(cache: PrefixCache, seed: int, steps: int = 1500) -> list:
    """Random requests against `cache` as the scheduler makes them (match, adopt, insert or
    abort, touch, evict for room, drop an idle adapter); the log of every step: the slots freed,
    in order, how many of them evicted, and the tree. The draws depend on the cache's state, so
    two caches give the same log only while they behave the same."""
    rng, kv, log = random.Random(seed), cache.kv, []
    running: list[list] = []    # each request's [adapter, tokens, slots, prefix]
    freed: list[int] = []
    free = kv.free
    kv.free = lambda slots: (freed.extend(slots.tolist()), free(slots))
    evicted = 0

    def evict(n: int) -> None:
        nonlocal evicted
        before = cache.num_cached
        cache.evict(n)
        evicted += before - cache.num_cached

    def alloc(n: int) -> np.ndarray | None:
        if kv.num_free < n:
            evict(n - kv.num_free)
        return kv.alloc(n)

    for _ in range(steps):
        op = rng.choices("raftde", weights=[6, 2, 9, 6, 0.2, 1])[0]
        adapter = rng.choice([None, None, "x", "y"])
        tokens = [rng.randrange(3) for _ in range(rng.randint(1, 12))]
        if op == "r":                                   # a request starts from its cached prefix
            prefix = cache.match(adapter, tokens[:-1])
            own = alloc(len(tokens) - (len(prefix) if prefix else 0))
            if own is None:
                cache.release(prefix)
            else:
                slots = np.concatenate([prefix.slots, own]) if prefix else own
                running.append([adapter, tokens, slots, prefix])
        elif op == "a" and running:                     # ... shares its prompt while running
            r = rng.choice(running)
            r[3], dup, _ = cache.adopt(r[0], r[1], r[2], r[3])
            kv.free(dup)
            r[2] = r[3].slots
        elif op == "f" and running:                     # ... finishes (kept, with decoded tokens) or aborts
            r = running.pop(rng.randrange(len(running)))
            start = len(r[3]) if r[3] else 0
            extra = [rng.randrange(3) for _ in range(rng.randint(0, 4))]
            more = alloc(len(extra)) if extra else np.empty(0, np.int64)
            if rng.random() < 0.8 and more is not None:
                kv.free(cache.insert(r[0], r[1] + extra, np.concatenate([r[2], more]), r[3]))
            else:
                cache.release(r[3])
                kv.free(r[2][start:])
                if more is not None:
                    kv.free(more)
        elif op == "t":                                 # a lookup refreshes a path
            cache.release(cache.match(adapter, tokens))
        elif op == "e":
            evict(rng.randint(1, 24))
        elif op == "d" and all(r[0] != adapter for r in running):
            cache.drop(adapter)
        nodes = _tree(cache)
        owned = sum(len(r[2]) - (len(r[3]) if r[3] else 0) for r in running)
        assert kv.num_free + cache.num_cached + owned == kv.num_slots       # no slot lost or freed twice
        assert cache.num_cached == sum(len(x.slots) for x in nodes)
        assert cache.num_evictable == sum(len(x.slots) for x in nodes if x.refs == 0)
        log.append((op, tuple(freed), evicted, {a: _snapshot(root) for a, root in cache.roots.items()}))
        freed.clear()
        evicted = 0
    return log


@pytest.mark.parametrize("seed", range(6))
def test_eviction_order_matches_a_full_scan_over_random_requests(seed):
    ours, oracle = _drive(PrefixCache(_pool(128)), seed), _drive(_ScanEvictCache(_pool(128)), seed)
    assert sum(evicted for _, _, evicted, _ in ours) > 1000          # the pool is tight: eviction is frequent
    for step, (a, b) in enumerate(zip(ours, oracle)):
        assert a == b, f"step {step}"


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
    assert [o.num_cached_tokens for o in out] == [0] + [len(prompt) - 1] * 3   # each output says so
    assert llm.engine.kv.num_used == cache.num_cached and cache.num_locked == 0


def test_a_start_shared_within_one_step_is_computed_once():
    """Requests sharing a start with a prompt the step being built completes wait one step and
    begin from its K/V (requests behind them go on); outputs equal those without the cache."""
    prompts = _workload(200)
    llm = LLM(None, enable_prefix_caching=True)
    outs = [o.token_ids for o in llm.generate(prompts, PARAMS[0])]
    assert outs == [o.token_ids for o in LLM(None).generate(prompts, PARAMS[0])]
    cache = llm.engine.scheduler.cache
    assert cache.hit >= (len(prompts) - 1) * 40      # the 40-token system prompt computed once

    engine = LLM(None, enable_prefix_caching=True).engine   # nothing cached yet
    other = [7] * 45
    a, b, c = (engine.make_request(100 + i, p, PARAMS[0], None) for i, p in enumerate([prompts[0], prompts[1], other]))
    for r in (a, b, c):
        engine.add(r)
    first = engine.scheduler.schedule()
    assert [ch.request for ch in first.chunks] == [a, c]     # b waits for a's prompt, c goes on
    engine.scheduler.share_prompts(first)
    second = engine.scheduler.schedule()
    assert [(ch.request, ch.start) for ch in second.chunks] == [(b, 40)]


def test_common_prefix_len_against_a_plain_walk():
    from compiled.runtime.prefix_cache import common_prefix_len
    rng = random.Random(1)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randint(0, 30))]
        b = a[:rng.randint(0, len(a))] + [rng.randrange(3) for _ in range(rng.randint(0, 30))]
        walk = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == walk
        start = rng.randint(0, len(b))   # a tree edge (a tuple) against tokens from an offset
        walk = next((i for i, (x, y) in enumerate(zip(a, b[start:])) if x != y), min(len(a), len(b) - start))
        assert common_prefix_len(tuple(a), b, start) == walk


def test_in_step_shared_prompt_check_is_the_common_prefix_rule():
    """`_shares_with_step` against its rule written out with a plain walk: a prompt the step completes
    starts with at least SHARED_PREFIX_WAIT_TOKENS of the request's tokens past its cached prefix,
    on random prompts sharing random lengths, with and without a cached prefix."""
    from compiled.attention.kv_cache import ReqToTokenPool
    from compiled.runtime.request import Request
    from compiled.runtime.scheduler import SHARED_PREFIX_WAIT_TOKENS as WAIT, Chunk, Scheduler
    s = Scheduler(_pool(8), ReqToTokenPool(4, 256, torch.device("cpu")), 4, 64, prefix_cache=True)
    rng = random.Random(0)
    seen = set()
    for i in range(300):
        base = [rng.randrange(50) for _ in range(120)]
        shared = rng.choice([0, 10, WAIT - 1, WAIT, WAIT + 1, 60, 120])
        prompt = base[:shared] + [rng.randrange(50, 99) for _ in range(rng.randrange(0, 40))]
        other = Request(id=2 * i, prompt=None, prompt_token_ids=prompt or [1], params=SamplingParams())
        chunk = Chunk(other, 0, len(other.prompt_token_ids), np.zeros(0, np.int64))
        request = Request(id=2 * i + 1, prompt=None, prompt_token_ids=base[:rng.randrange(1, 121)],
                          params=SamplingParams())
        cached = rng.choice([0, 0, 5, 20, 40])
        cached = min(cached, request.num_tokens - 1)
        prefix = [0] * cached if cached else None
        tokens = request.token_ids(0, request.num_tokens - 1)
        walk = next((i for i, (x, y) in enumerate(zip(other.prompt_token_ids, tokens)) if x != y),
                    min(len(other.prompt_token_ids), len(tokens)))
        expected = walk - cached >= WAIT
        assert s._shares_with_step(request, prefix, [chunk]) == expected, (shared, cached, len(tokens))
        seen.add(expected)
    assert seen == {True, False}
