"""Tensor parallelism on GPUs (NCCL all-reduces inside the CUDA graphs): TP=2 and TP=4 prompt
logprobs and greedy tokens against TP=1 on the demo MoE in fp32 (with and without expert
parallelism, and with each prompt's prefill replayed as one prompt graph), on the demo dense model
in bf16, and on a block-FP8 MoE whose expert shards start inside a 128-wide scale block (against its
dequantized twin); then the group's shutdown leaves the process group (NCCL tears a communicator
down with every rank of the host). A world skips on a host with fewer GPUs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from compiled import LLM, SamplingParams
from compiled.demo import DENSE_MODEL, MOE_MODEL
from compiled.passes.variant import BASE
from tests.conftest import make_checkpoint, prompt_logprob_gap
from tests.quant.checkpoints import BLOCK_FP8, quantize_checkpoint

pytestmark = pytest.mark.gpu

ENGINE = dict(device="cuda", max_num_batched_tokens=512, kv_cache_tokens=8192, max_model_len=512)
WORLDS = [2, 4]
PROMPTS = [[(5 * i) % 250 + 1 for i in range(n)] for n in (301, 3, 150)]   # the demo holds 512 positions
PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=1)


def _generate(llm: LLM, lone: bool):
    """PROMPTS' outputs: all in one call, or each prompt in a call of its own (so that its prefill
    is a step of one chunk, which the prompt graphs serve)."""
    if not lone:
        return llm.generate(PROMPTS, PARAMS)
    return [llm.generate([prompt], PARAMS)[0] for prompt in PROMPTS]


def _compare(model: str, world: int, expert_parallel: bool = False, reference: str | None = None,
             lone: bool = False, **extra):
    """TP=world and TP=1 outputs (TP=1 of `reference` when given), and the largest and mean
    difference of their prompt logprobs. `lone`: each prompt generated alone, and rank 0 replays a
    prompt graph for each."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    alone = LLM(reference or model, **ENGINE, **extra)
    ref = _generate(alone, lone)
    del alone
    split = LLM(model, tensor_parallel_size=world, enable_expert_parallel=expert_parallel, **ENGINE, **extra)
    try:
        prompt_graphs = split.engine.runner.variants[BASE].prompt
        before = prompt_graphs.replays
        out = _generate(split, lone)
        assert split.engine.runner.tp is not None and split.engine.num_overlapped > 0
        assert prompt_graphs.replays == before + (len(PROMPTS) if lone else 0)
    finally:
        split.shutdown()
    assert not dist.is_initialized()   # every rank left the group, none waited for a peer gone first
    return (out, ref, *prompt_logprob_gap(out, ref))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_demo_moe_tp_equals_tp1_fp32(world, expert_parallel):
    """In fp32 the sharded model equals the whole one up to the order of sums."""
    out, ref, worst, _ = _compare(MOE_MODEL, world, expert_parallel, dtype="float32")
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert worst < 1e-3, worst


@pytest.mark.parametrize("world", WORLDS)
def test_demo_moe_tp_prompt_graphs_fp32(world):
    """Each prompt's prefill as one graph whose all-reduces NCCL captured on every rank."""
    out, ref, worst, _ = _compare(MOE_MODEL, world, lone=True, dtype="float32")
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert worst < 1e-3, worst


@pytest.mark.parametrize("world", WORLDS)
def test_demo_dense_tp_bf16_greedy_equal(world):
    out, ref, worst, mean = _compare(DENSE_MODEL, world)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert mean < 0.05, (mean, worst)


@pytest.mark.parametrize("world", WORLDS)
def test_fp8_moe_with_shards_inside_a_scale_block(tmp_path, world):
    """Block FP8 (128 x 128) with 320-wide experts, 160 a rank at TP=2 and 80 at TP=4: a rank's
    slice starts inside a scale block. Against the bf16 model holding the dequantized weights, within
    what the FP8 dots' per-token activation rounding moves this model's logprobs at TP=1."""
    src = make_checkpoint(tmp_path / "src", moe=True, seed=3, hidden_size=256, moe_intermediate_size=320,
                          intermediate_size=384, num_attention_heads=4, head_dim=64, vocab_size=288,
                          max_position_embeddings=512)
    path, reference = quantize_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", BLOCK_FP8)
    out, ref, worst, mean = _compare(path, world, reference=reference)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert mean < 0.15 and worst < 2.0, (mean, worst)
