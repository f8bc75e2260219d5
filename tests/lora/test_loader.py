"""The slot loader's background path (its own thread, factors sent in pieces through a staging
ring) against plain copies; on the CPU the ring is ordinary memory, the rest is the same code."""

from __future__ import annotations

import time

import pytest
import torch

from compiled import LLM, SamplingParams
from compiled.demo import MOE_ADAPTERS, MOE_MODEL
from compiled.lora import loader as L
from compiled.lora.loader import SlotLoader, SlotWrite, write_now


def _slots(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3, 5, 6, 7, generator=g), "b": torch.randn(3, 11, 4, generator=g),
            "scale": torch.randn(3, 2, generator=g)}


def _writes(bufs: dict[str, torch.Tensor], slot: int, seed: int) -> list[SlotWrite]:
    """Zero a slot, then factors of rank 3 into strided views of rank-4 buffers, a factor shared
    by every expert (a broadcast view), one into a contiguous view, and scales."""
    g = torch.Generator().manual_seed(seed)
    a, b, scale = bufs["a"], bufs["b"], bufs["scale"]
    shared = torch.randn(1, 3, 7, generator=g).expand(5, 3, 7)
    return [SlotWrite(a[slot]), SlotWrite(b[slot]), SlotWrite(scale[slot]),
            SlotWrite(a[slot, :, :3], shared),
            SlotWrite(b[slot, :, :3], torch.randn(11, 3, generator=g)),
            SlotWrite(a[slot, 0, 3:], torch.randn(3, 7, generator=g)),   # a contiguous view
            SlotWrite(scale[slot, 0], value=0.5), SlotWrite(scale[slot, 1], value=2.0)]


@pytest.fixture
def small_ring(monkeypatch):
    # 64 bytes: most factors go in several pieces, and the ring wraps many times
    monkeypatch.setattr(L, "STAGING_BYTES", 64)


@pytest.mark.parametrize("loader", ["SlotLoader", "LockedLoader"])
def test_a_background_load_equals_plain_copies(small_ring, loader):
    direct, staged = _slots(0), _slots(0)
    write_now(_writes(direct, 1, seed=7))
    loader = globals()[loader](torch.device("cpu"), background=True)
    loader.load(1, _writes(staged, 1, seed=7))
    loader.wait(1)
    assert loader.ready(1)
    for name in direct:
        assert torch.equal(direct[name], staged[name]), name
    assert not torch.equal(staged["a"][1, :, 3:], _slots(0)["a"][1, :, 3:])   # the zeroing reached the padding


def test_loads_into_one_slot_land_in_order(small_ring):
    bufs, expected = _slots(1), _slots(1)
    loader = SlotLoader(torch.device("cpu"), background=True)
    for seed in (3, 4, 5):
        loader.load(2, _writes(bufs, 2, seed))
    loader.load(0, _writes(bufs, 0, seed=6))
    loader.wait(2), loader.wait(0)
    write_now(_writes(expected, 2, seed=5))
    write_now(_writes(expected, 0, seed=6))
    for name in bufs:
        assert torch.equal(bufs[name], expected[name]), name


def test_a_failed_load_is_raised_to_whoever_asks_about_its_slot(small_ring):
    bufs = _slots(2)
    loader = SlotLoader(torch.device("cpu"), background=True)
    loader.load(0, [SlotWrite(bufs["b"][0, :, :3], torch.randn(11, 2))])   # wrong rank
    with pytest.raises(RuntimeError):
        loader.wait(0)
    with pytest.raises(RuntimeError):
        loader.ready(0)
    loader.load(0, _writes(bufs, 0, seed=1))   # the slot takes a good load afterwards
    loader.wait(0)
    assert loader.ready(0)


class SlowLoader(SlotLoader):
    """Each load takes 30 ms more: requests behind it find it in flight."""

    def _carry_out(self, writes, locked):
        time.sleep(0.03)
        super()._carry_out(writes, locked)


class LockedLoader(SlotLoader):
    """Takes every load's factors as page-locked: the direct path (copies into the slot where its
    view is contiguous, the staging buffers where not, no ring), run on the CPU."""

    def _carry_out(self, writes, locked):
        super()._carry_out(writes, True)


@pytest.mark.parametrize("loader", [SlotLoader, SlowLoader, LockedLoader])
def test_an_engine_with_background_loads_gives_the_outputs_of_plain_copies(small_ring, loader):
    """Expert adapters through one slot loaded in the background: requests wait for their
    adapter's copy (the engine's own checks, nothing mocked), none takes the slot of an adapter
    still being copied in for a request before it, and each gets what plain copies give."""
    names = list(MOE_ADAPTERS)
    kwargs = dict(device="cpu", dtype="float32", lora_modules=MOE_ADAPTERS, max_loras_per_batch=1)
    prompts = [[5, 9, 2, 7], [11, 3, 8], [4, 4, 6, 1, 2], [13, 2]]
    rows = [names[0], names[1], None, names[0]]
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    plain = LLM(MOE_MODEL, **kwargs)
    expected = [o.token_ids for o in plain.generate(prompts, greedy, lora=rows)]
    llm = LLM(MOE_MODEL, **kwargs)
    llm.engine.loras.loader = loader(torch.device("cpu"), background=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy, lora=rows)] == expected
    assert llm.engine.kv.num_used == 0


def test_the_head_of_the_queue_waits_for_copies_that_hold_every_free_slot(small_ring):
    """One slot, being copied into for an adapter no request uses (as when a retracted request
    comes back to the head of the queue): the head's request waits for that copy, then for its
    own, instead of finding nothing to run."""
    names = list(MOE_ADAPTERS)
    kwargs = dict(device="cpu", dtype="float32", lora_modules=MOE_ADAPTERS, max_loras_per_batch=1)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    expected = LLM(MOE_MODEL, **kwargs).generate([[5, 9, 2]], greedy, lora=names[1])[0].token_ids
    llm = LLM(MOE_MODEL, **kwargs)
    pool = llm.engine.loras
    pool.loader = SlowLoader(torch.device("cpu"), background=True)
    pool.in_slot, pool.slot_of = [None], {}
    pool.acquire(names[0], set())
    assert pool.loader.in_flight(0)
    assert llm.generate([[5, 9, 2]], greedy, lora=names[1])[0].token_ids == expected


class LandsWhileLookedAt(SlotLoader):
    """Each copy lands just after the first look at it: the scheduler finds it under way, and
    any later look finds it landed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.looked: set[int] = set()

    def load(self, slot, writes, source=None) -> None:
        super().load(slot, writes, source)
        self.looked.discard(slot)

    def ready(self, slot: int) -> bool:
        self.wait(slot)
        if slot in self.looked:
            return super().ready(slot)
        self.looked.add(slot)
        return False


def test_a_copy_landing_after_the_scheduler_looked_is_waited_for_not_an_error():
    """The request held back by its adapter's copy is admitted once the copy has landed, even
    though the copy lands before the engine asks why nothing could run."""
    names = list(MOE_ADAPTERS)
    kwargs = dict(device="cpu", dtype="float32", lora_modules=MOE_ADAPTERS, max_loras_per_batch=1)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    prompts, rows = [[5, 9, 2], [7, 1]], [names[1], names[0]]
    expected = [o.token_ids for o in LLM(MOE_MODEL, **kwargs).generate(prompts, greedy, lora=rows)]
    llm = LLM(MOE_MODEL, **kwargs)
    llm.engine.loras.loader = LandsWhileLookedAt(torch.device("cpu"), background=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy, lora=rows)] == expected


@pytest.mark.gpu
def test_page_locked_loads_on_the_gpu_give_the_outputs_of_pageable_ones():
    """On a GPU the CPU tier's blocks are page-locked and loads DMA from them; the same engine
    with its blocks unlocked (the staging ring's path) gives the same tokens."""
    names = list(MOE_ADAPTERS)
    kwargs = dict(device="cuda", dtype="float32", lora_modules=MOE_ADAPTERS, max_loras_per_batch=1)
    prompts = [[5, 9, 2, 7], [11, 3, 8], [4, 4, 6, 1, 2], [13, 2]]
    rows = [names[0], names[1], None, names[1]]
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    locked, pageable = LLM(MOE_MODEL, **kwargs), LLM(MOE_MODEL, **kwargs)
    for adapter in locked.engine.loras.adapters.values():
        assert adapter.host.locked and next(adapter.factors()).is_pinned()
    for adapter in pageable.engine.loras.adapters.values():
        adapter.host.unlock()
        assert not next(adapter.factors()).is_pinned()
    assert ([o.token_ids for o in locked.generate(prompts, greedy, lora=rows)]
            == [o.token_ids for o in pageable.generate(prompts, greedy, lora=rows)])


@pytest.mark.gpu
def test_a_refused_page_lock_leaves_the_block_pageable_and_cuda_usable():
    """Locking memory already locked is refused: the block stays pageable, and the refusal does
    not surface later as the error of an unrelated kernel launch."""
    from compiled.lora.host import HostBlock
    first = HostBlock(1 << 20)
    assert first.lock()
    second = HostBlock(0)
    second.data = first.data   # the same pages
    assert not second.lock() and not second.locked
    y = torch.ones(1000, device="cuda") * 2   # torch checks the last error after this launch
    torch.cuda.synchronize()
    assert float(y.sum()) == 2000.0
