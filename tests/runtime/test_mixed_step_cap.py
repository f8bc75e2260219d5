"""The mixed-step cap: while some requests decode, a step carries at most `max_mixed_step_tokens`
tokens in all, their decodes first; with nothing decoding a prompt takes the whole budget, and
with as many decoding as the cap, prompts wait. Outputs do not depend on the cap."""

from __future__ import annotations

import pytest
import torch

from compiled import LLM, SamplingParams
from compiled.attention.context import (DECODE_ROWS_ANY_PREFIX, DECODE_ROWS_MAX_CHUNK, DECODE_ROWS_PREFIX_A_TOKEN,
                                       decode_kernel_share)
from compiled.attention.kv_cache import KVPool, ReqToTokenPool
from compiled.attention.ops import token_lens
from compiled.demo import MOE_MODEL
from compiled.runtime.request import Request
from compiled.runtime.scheduler import Scheduler


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def _step(s: Scheduler) -> list[tuple[int, int, int]]:
    """One step; a chunk reaching its request's end samples a token. (id, start, length) per chunk."""
    out = []
    for c in s.schedule().chunks:
        if c.samples:
            c.request.output_token_ids.append(3)
            if len(c.request.output_token_ids) == c.request.params.max_new_tokens:
                s.finish(c.request)
        out.append((c.request.id, c.start, c.length))
    return out


def test_prefill_beside_decodes_is_capped():
    kv = KVPool(1, 64, 1, 4, torch.float32, torch.device("cpu"))
    s = Scheduler(kv, ReqToTokenPool(8, 64, torch.device("cpu")), 8, 16, max_mixed_step_tokens=6)
    s.add(Request(id=0, prompt=None, prompt_token_ids=[1] * 3, params=_greedy(3)))
    assert _step(s) == [(0, 0, 3)]
    s.add(Request(id=1, prompt=None, prompt_token_ids=[1] * 20, params=_greedy(2)))
    s.add(Request(id=2, prompt=None, prompt_token_ids=[1] * 4, params=_greedy(2)))
    assert _step(s) == [(0, 3, 1), (1, 0, 5)]                 # 1 + 5 tokens, not 1 + 15
    assert _step(s) == [(0, 4, 1), (1, 5, 5)]                 # request 0 finishes
    assert _step(s) == [(1, 10, 10), (2, 0, 4)]               # nothing decodes: the whole budget
    assert _step(s) == [(1, 20, 1), (2, 4, 1)]


@pytest.mark.parametrize("cap", [1, 7])   # 1: no prompt runs beside a decode
def test_outputs_do_not_depend_on_the_cap(cap):
    prompts = [[5, 9, 2], list(range(3, 40)), [11] * 17, list(range(60, 85))]
    params = [_greedy(n) for n in (12, 4, 9, 6)]
    engine = dict(device="cpu", dtype="float32", max_model_len=64, max_num_batched_tokens=32)
    capped = LLM(MOE_MODEL, max_mixed_step_tokens=cap, **engine).generate(prompts, params)
    free = LLM(MOE_MODEL, max_mixed_step_tokens=None, **engine).generate(prompts, params)
    assert [o.token_ids for o in capped] == [o.token_ids for o in free]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_outputs_do_not_depend_on_the_cap(monkeypatch):
    """On the Triton kernels, with a cap that leaves prompt tails beside decodes: a 3-token tail
    over 61 cached tokens attends as decode rows, a 21-token one over 29 through the extend kernel."""
    import compiled.attention.ops as ops
    original, calls = ops._token_rows_triton, []

    def counted(*args):
        calls.append(args[0].meta.token_rows.shape[0])
        return original(*args)
    monkeypatch.setattr(ops, "_token_rows_triton", counted)
    prompts = [[5, 9, 2], list(range(3, 67)), [11] * 50, list(range(60, 85))]
    params = [_greedy(n) for n in (12, 4, 9, 6)]
    engine = dict(device="cuda", dtype="float32", max_model_len=96, max_num_batched_tokens=64)
    capped = LLM(MOE_MODEL, max_mixed_step_tokens=33, **engine).generate(prompts, params)
    free = LLM(MOE_MODEL, max_mixed_step_tokens=None, **engine).generate(prompts, params)
    assert [o.token_ids for o in capped] == [o.token_ids for o in free]
    assert 4 in calls   # the step of two decodes and the 3-token tail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_token_rows_compile_nothing_after_start(monkeypatch):
    """The decode kernel as token rows launch it compiles at start (`warm_token_rows`), not in the
    first step with a prompt tail beside decodes, which every running request would wait for."""
    from triton import knobs
    import compiled.attention.ops as ops
    llm = LLM(MOE_MODEL, device="cuda", dtype="bfloat16", max_model_len=96, max_num_batched_tokens=64,
              max_mixed_step_tokens=33)
    original, rows, compiled = ops._token_rows_triton, [], []

    def counted(*args):
        rows.append(args[0].meta.token_rows.shape[0])
        return original(*args)

    def listen(*, metadata: dict, cache_hit: bool, **_) -> None:
        compiled.append(metadata.get("name", "?"))
    monkeypatch.setattr(ops, "_token_rows_triton", counted)
    monkeypatch.setattr(knobs.compilation, "listener", listen)
    llm.generate([[5, 9, 2], list(range(3, 67)), [11] * 50], [_greedy(n) for n in (12, 4, 9)])
    assert 4 in rows                                              # two decodes and a 3-token tail
    assert not [name for name in compiled if "decode" in name], compiled


def test_warm_token_rows_launches_each_split_count_once(monkeypatch):
    """One launch for each split count that 1 .. (table rows) token rows take, as `_token_rows_triton`
    launches it (no K/V to store, no norm or RoPE), over the padding request's row."""
    import compiled.attention.triton_decode as td
    from compiled.attention.ops import warm_token_rows
    kv = KVPool(2, 64, 2, 16, torch.float32, torch.device("cpu"))
    table = ReqToTokenPool(40, 32, torch.device("cpu"))
    launches = []

    def launch(q, k_cache, v_cache, req_to_token, rows, lens, scale, ws, **kw):
        launches.append((q.shape, rows.tolist(), lens.tolist(), rows.dtype, kw, ws.splits_for(q.shape[0])))
    monkeypatch.setattr(td, "decode_attention_triton", launch)
    assert warm_token_rows(kv, table.table, table.padding_row, 8, torch.float32, torch.int64) == len(launches)
    ws_splits = [entry[-1] for entry in launches]
    assert ws_splits == sorted(set(ws_splits), reverse=True) and len(launches) > 1
    every = {td.num_kv_splits(b, 2, td.CPU_SMS) for b in range(1, table.table.shape[0] + 1)}
    assert set(ws_splits) == every
    for shape, rows, lens, dtype, kw, _ in launches:
        assert shape[1:] == (8, 16) and rows == [table.padding_row] * shape[0] and lens == [1] * shape[0]
        assert dtype == torch.int64 and kw == {}


def test_one_token_chunks_lead_the_step():
    """The attention of a mixed step runs its leading one-token chunks through the decode kernel,
    so a batch puts them first: here a request admitted with all but its last prompt token cached
    goes before the prompt still being chunked that was admitted before it."""
    kv = KVPool(1, 256, 1, 4, torch.float32, torch.device("cpu"))
    s = Scheduler(kv, ReqToTokenPool(8, 128, torch.device("cpu")), 8, 12, prefix_cache=True,
                  max_mixed_step_tokens=8)
    cached = list(range(100, 110))
    s.add(Request(id=0, prompt=None, prompt_token_ids=cached, params=_greedy(1)))
    assert _step(s) == [(0, 0, 10)]                           # finishes; its prompt stays cached
    s.add(Request(id=1, prompt=None, prompt_token_ids=[5], params=_greedy(20)))
    assert _step(s) == [(1, 0, 1)]
    s.add(Request(id=2, prompt=None, prompt_token_ids=list(range(200, 216)), params=_greedy(2)))
    assert _step(s) == [(1, 1, 1), (2, 0, 7)]
    assert _step(s) == [(1, 2, 1), (2, 7, 7)]
    s.add(Request(id=3, prompt=None, prompt_token_ids=cached, params=_greedy(2)))
    assert [r.id for r in s.running] == [1, 2]
    assert _step(s) == [(1, 3, 1), (3, 9, 1), (2, 14, 2)]     # running order would be 1, 2, 3


def test_decode_kernel_share_stops_at_the_first_chunk_it_leaves_out():
    few, over = DECODE_ROWS_ANY_PREFIX, DECODE_ROWS_ANY_PREFIX + 4
    long_prefix = DECODE_ROWS_PREFIX_A_TOKEN * (over - DECODE_ROWS_ANY_PREFIX)
    chunks = [(1, 100), (1, 7), (few, 0), (over, long_prefix), (over, long_prefix - 1), (2, 3000)]
    assert decode_kernel_share(chunks, 64) == (4, 2 + few + over)
    assert decode_kernel_share(chunks, 2 + few) == (3, 2 + few)            # the rows it has
    assert decode_kernel_share([(over, 0), (1, 5)], 64) == (0, 0)
    assert decode_kernel_share([(DECODE_ROWS_MAX_CHUNK + 1, 10 ** 6)], 64) == (0, 0)


def test_a_short_chunk_attends_as_decode_rows():
    """The runner lays out a step of a decode and a prompt's 12-token tail over the 64 tokens the
    mixed-step cap let through before for the decode kernel: both requests lead (`decode_rows`),
    each token a row of its own, on its request's table row, its context (position + 1) its length."""
    tail = DECODE_ROWS_ANY_PREFIX + 4
    head = DECODE_ROWS_PREFIX_A_TOKEN * (tail - DECODE_ROWS_ANY_PREFIX)
    llm = LLM(MOE_MODEL, device="cpu", dtype="float32", max_model_len=96, max_num_batched_tokens=96,
              max_mixed_step_tokens=head + 1)
    eng = llm.engine
    first = eng.make_request(0, [5, 9, 2], _greedy(8))
    eng.add(first)
    while not first.output_token_ids:
        eng.step()
    second = eng.make_request(1, list(range(3, 3 + head + tail)), _greedy(2))
    eng.add(second)
    while second.num_computed < head:                         # the decode and the prompt's head
        eng.step()
    batch = eng.scheduler.schedule()
    assert [(c.request.id, c.length) for c in batch.chunks] == [(0, 1), (1, tail)]
    meta = eng.runner._stage(batch.chunks, batch.num_tokens)
    rows = [c.request.row for c in batch.chunks]
    assert meta.decode_rows == 2 and meta.max_extend_len == 0
    assert meta.token_rows.tolist() == [rows[0]] + [rows[1]] * tail
    assert token_lens(meta).tolist() == [batch.chunks[0].start + 1] + list(range(head + 1, head + tail + 1))
