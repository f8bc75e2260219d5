"""GPU: Inductor + decode CUDA graphs + prefill graphs (piecewise; a lone prompt's whole step)
against the uncompiled graph (same passes, same dummy weights), at every bucket and between
buckets; and no recompilation over 200 batch sizes; decode buckets captured on first use,
part-way through a generation."""

from __future__ import annotations

import math
import random

import pytest

from compiled import LLM, SamplingParams
from compiled.compilation.buckets import smallest_bucket
from compiled.compilation.inductor import COMPILES
from compiled.passes.variant import BASE
from tests.conftest import reduced_real_config

pytestmark = pytest.mark.gpu
BUCKETS = [1, 2, 4, 8, 12, 16, 24, 32]   # 12 and 24 are captured on first use (eager_buckets)


@pytest.fixture(scope="module")
def reduced_30b(tmp_path_factory):
    """The Qwen3-30B-A3B shape with 4 layers (every layer shape of the real model)."""
    return reduced_real_config(tmp_path_factory.mktemp("qwen3-30b-a3b-4l"))


@pytest.fixture(scope="module")
def pair(reduced_30b):
    common = dict(device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=2048, max_num_seqs=64,
                  max_num_batched_tokens=4096, kv_cache_tokens=32768, seed=3)
    fast = LLM(reduced_30b, compile=True, cuda_graph_buckets=BUCKETS, **common)
    plain = LLM(reduced_30b, compile=False, cuda_graph_buckets=[], **common)
    return fast, plain


def _step_logprobs(llm: LLM, batch: int, seed: int):
    rng = random.Random(seed)
    vocab = llm.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(5, 300))] for _ in range(batch)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True, logprobs=8))
    return outs


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 7, 8, 10, 13, 16, 31, 32, 40])
def test_compiled_graphs_match_uncompiled(pair, batch):
    fast, plain = pair
    assert fast.engine.runner.variants[BASE].decode is not None and plain.engine.runner.variants[BASE].decode is None
    fast_graphs, plain_graphs = fast.engine.runner.variants[BASE], plain.engine.runner.variants[BASE]
    assert fast_graphs.piecewise is not None and plain_graphs.piecewise is None
    replays = fast_graphs.piecewise.replays + fast_graphs.prompt.replays
    a, b = _step_logprobs(fast, batch, batch), _step_logprobs(plain, batch, batch)
    if sum(len(o.prompt_token_ids) for o in a) <= fast.engine.runner.prefill_buckets[-1]:
        # the prefill replayed graphs: a lone prompt's own, several prompts' the pieces'
        assert fast_graphs.piecewise.replays + fast_graphs.prompt.replays > replays
    assert_two_steps_close(a, b, batch)


def assert_two_steps_close(a, b, batch: int) -> None:
    """The top logprobs of the two steps of outputs `a` (compiled) and `b` (uncompiled) agree."""
    worst, scale = 0.0, 0.0
    for x, y in zip(a, b):
        if x.token_ids[0] != y.token_ids[0]:   # only a near-tie (within the bound below) may flip
            chosen = y.logprobs[0][x.token_ids[0]]
            assert abs(x.logprobs[0][x.token_ids[0]] - chosen) < 0.02 + 2 * _bf16_ulp(abs(chosen))
            continue  # a near-tie in prefill changed the decode input; the step is not comparable
        for step in (0, 1):  # 0: prefill row (piecewise graphs), 1: decode (a full graph when batch <= 32)
            common = set(x.logprobs[step]) & set(y.logprobs[step])
            assert len(common) >= 4
            worst = max(worst, max(abs(x.logprobs[step][t] - y.logprobs[step][t]) for t in common))
            scale = max(scale, max(abs(y.logprobs[step][t]) for t in common))
    # Random weights give nearly flat logprobs around -log(V) ~ -12, where the bf16 logits that
    # both paths round differently (fusions) are 1/16 apart: allow two such steps.
    print(f"batch {batch}: max |dlogprob| {worst:.4f} at |logprob| <= {scale:.1f}")
    assert worst < 0.02 + 2 * _bf16_ulp(scale)


@pytest.mark.parametrize("batch", [1, 5, 32])
def test_decode_graphs_argmax_is_torchs(pair, batch):
    """The graphs' in-graph argmax (greedy's tokens) over the logits of their last replay."""
    import torch
    fast, _ = pair
    _step_logprobs(fast, batch, 100 + batch)   # its last step replays the batch's decode graph
    graphs = fast.engine.runner.variants[BASE].decode
    assert torch.equal(graphs.argmax[:batch], graphs.logits[:batch].argmax(-1))


def test_bucket_captured_part_way_through_a_generation(pair):
    """30 requests of which 10 stop after 2 tokens: the batch drops from 30 (bucket 32) to 20,
    whose bucket 24 is captured between decode steps, overlapped ones before and after (and the
    prefill's token bucket, unless an earlier test needed it). The tokens equal those of the same
    generate again, which replays them."""
    fast, _ = pair
    graphs = fast.engine.runner.variants[BASE].decode
    assert 24 in graphs.pending and 32 not in graphs.pending
    rng = random.Random(7)
    vocab = fast.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(5, 60))] for _ in range(30)]
    params = [SamplingParams(max_new_tokens=2 if i < 10 else 12, temperature=0.0, ignore_eos=True)
              for i in range(30)]
    prefill = smallest_bucket(fast.engine.runner.prefill_buckets, sum(len(p) for p in prompts))
    before = fast.engine.num_overlapped
    first = fast.generate(prompts, params)
    assert 24 not in graphs.pending and fast.engine.num_overlapped > before
    assert not fast.engine.runner.variants[BASE].piecewise.is_pending(prefill)
    again = fast.generate(prompts, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    base = fast.engine.runner.variants[BASE]
    pending = len(graphs.pending) + len(base.piecewise.pending) + len(base.prompt.pending)
    assert fast.engine.capture_pending_graphs() == pending > 0
    assert graphs.pending == [] and base.piecewise.pending == [] and base.prompt.pending == []


def test_piecewise_graphs_read_every_activation_in_place(pair):
    """Attention writes into the slab the next piece's graph reads, and each piece reads the
    previous piece's outputs where its graph left them: no input is copied before a replay."""
    fast, _ = pair
    fast.engine.capture_pending_graphs()
    entries = [e for piece in fast.engine.runner.model.pieces for e in piece.graphs.entries.values()]
    assert len(entries) == len(fast.engine.runner.model.pieces) * len(fast.engine.runner.prefill_buckets)
    assert all(i is None or i.slab is None for e in entries for i in e.inputs)


def _bf16_ulp(x: float) -> float:
    """Spacing of bfloat16 numbers at magnitude x (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(x, 1e-30))) - 7)


def test_no_recompilation_over_200_batch_sizes(pair):
    fast, _ = pair
    before = COMPILES["count"]
    rng = random.Random(0)
    vocab = fast.model_config.vocab_size
    for _ in range(200):
        batch = rng.randint(1, 40)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 64))] for _ in range(batch)]
        fast.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert COMPILES["count"] == before


@pytest.mark.parametrize("batch", [1, 5, 32, 40])
def test_overlap_schedule_same_tokens_as_synchronous(pair, batch):
    """Decode steps launched ahead of the previous step's read-back (full decode graphs up to 32
    rows, piecewise graphs past them) give exactly the tokens of synchronous steps."""
    fast, _ = pair
    rng = random.Random(100 + batch)
    vocab = fast.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(5, 120))] for _ in range(batch)]
    params = [SamplingParams(max_new_tokens=rng.randint(2, 24), temperature=0.0, ignore_eos=True) for _ in prompts]
    engine = fast.engine
    before = engine.num_overlapped
    overlapped = fast.generate(prompts, params)
    assert engine.num_overlapped > before
    engine.overlap_schedule = False
    try:
        plain = fast.generate(prompts, params)
    finally:
        engine.overlap_schedule = True
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in plain]
    assert engine.kv.num_used == 0

