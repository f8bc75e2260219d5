"""The one-chunk prefill graphs' host side (the graphs themselves need CUDA:
test_gpu_prompt_graphs.py): which steps they take, and the two-request layout their staging leaves
in the static inputs (the chunk, then the padding request, empty where the chunk fills the bucket)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn

from compiled import LLM
from compiled.demo import MOE_MODEL
from compiled.runtime.prompt_graphs import MAX_PREFIX, REQUESTS, PromptGraphs
from compiled.runtime.scheduler import Chunk
from compiled.runtime.tensor_parallel import _SentRequest

BUCKETS = [16, 32, 64]


def _chunk(start: int, length: int, row: int = 0) -> Chunk:
    ids = list(range(100, 100 + start + length))
    return Chunk(_SentRequest(row, -1, 0, ids), start, length, np.arange(1, 1 + length, dtype=np.int64))


def _graphs(runner=None) -> PromptGraphs:
    if runner is None:
        return PromptGraphs(nn.Identity(), nn.Linear(4, 8), None, None, None, None, None, BUCKETS, None,
                            torch.device("cpu"))
    return PromptGraphs(runner.model, runner.model.lm_head, runner.kv, runner.req_pool, runner.inputs,
                        functools.partial(runner._stage, seqs=REQUESTS), None, BUCKETS, None, torch.device("cpu"))


def test_one_chunk_sampling_its_last_token_or_nothing_takes_the_bucket():
    graphs = _graphs()
    assert graphs.serves([_chunk(0, 10)], [9]) == 16
    assert graphs.serves([_chunk(0, 10)], []) == 16
    assert graphs.serves([_chunk(MAX_PREFIX, 33)], [32]) == 64
    assert graphs.serves([_chunk(0, 64)], [63]) == 64


@pytest.mark.parametrize("chunks, rows", [
    ([_chunk(0, 10), _chunk(0, 5, row=1)], [9, 14]),   # two chunks: the piecewise graphs
    ([_chunk(0, 10)], [3]),                            # another row's logits asked for
    ([_chunk(0, 10)], [8, 9]),
    ([_chunk(MAX_PREFIX + 1, 10)], [9]),               # a prefix past the graphs' tiles
    ([_chunk(0, 65)], [64]),                           # past the largest bucket
])
def test_other_steps_are_not_the_graphs(chunks, rows):
    assert _graphs().serves(chunks, rows) is None


@pytest.fixture(scope="module")
def runner():
    return LLM(MOE_MODEL, device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4).engine.runner


@pytest.mark.parametrize("length, padding", [(16, 0), (10, 6), (0, 16)])
def test_staging_lays_out_two_requests(runner, length, padding):
    """The chunk (none: the capture's padding-only batch) first, the padding request after it over
    the bucket's other tokens, an empty request where there are none."""
    graphs, pad = _graphs(runner), runner.req_pool.padding_row
    chunks = [_chunk(0, length, row=2)] if length else []
    graphs.stage(chunks, 16)
    h = runner.inputs.host
    first_row, first_len = (2, length) if length else (pad, padding)
    rest = (pad, padding) if length else (pad, 0)
    assert list(h["req_pool_indices"][:REQUESTS]) == [first_row, rest[0]]
    assert list(h["extend_lens"][:REQUESTS]) == list(h["seq_lens"][:REQUESTS]) == [first_len, rest[1]]
    assert list(h["extend_start_loc"][:REQUESTS]) == [0, first_len]
    if length:
        assert list(h["input_ids"][:length]) == list(range(100, 100 + length))
        assert list(h["out_cache_loc"][:length]) == list(range(1, 1 + length))
    assert all(h["token_rows"][length:16] == pad) and all(h["positions"][length:16] == 0)
