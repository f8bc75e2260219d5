"""Tensor parallelism inside context parallelism on CPU (gloo, fp32): TP=2 x CP=2 (4 processes)
gives one process's prompt logprobs (whole vocabulary) and greedy tokens, for one batch of prompts
of odd lengths whose long ones split over the context-parallel ranks (each a tensor-parallel
group): a random dense model whose vocabulary (123) does not divide by 2, spawned, with a prompt
starting from its cached prefix (run by rank 0's tensor-parallel group alone) and a killed rank;
the demo MoE under torchrun (WORLD_SIZE = 4); more processes than visible GPUs refused."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from compiled import LLM, SamplingParams
from compiled.errors import ConfigError
from compiled.parallel.group import CPError
from tests.conftest import assert_same_outputs, make_checkpoint, torchrun_result

# 64-token steps: the 150-token prompt is prefilled in three chunks, each split over its cached prefix.
ENGINE = dict(max_num_batched_tokens=64, cp_min_tokens=8, kv_cache_tokens=2048, max_model_len=256,
              enable_prefix_caching=True, logits_chunk=40)
LENGTHS = (37, 3, 50, 150)
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=-1)
AGAIN = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


def _prompts(vocab: int) -> list[list[int]]:
    return [[(7 * i + 3 * n) % (vocab - 1) + 1 for i in range(n)] for n in LENGTHS]


def _reference(model: str | None) -> tuple[list[list[int]], list, list]:
    """One process's prompts, outputs and a repeat of the third prompt (from its cached prefix)."""
    llm = LLM(model, **ENGINE)
    prompts = _prompts(llm.model_config.vocab_size)
    return prompts, llm.generate(prompts, PARAMS), llm.generate(prompts[2:3], AGAIN)


def test_tp_2_by_cp_2_equals_one_process_and_a_killed_rank_ends_generate(tmp_path, one_intra_op_thread):
    model = make_checkpoint(tmp_path / "dense", seed=1, num_hidden_layers=2, vocab_size=123)
    _, reference, ref_again = _reference(model)
    llm = LLM(model, tensor_parallel_size=2, context_parallel_size=2, cp_timeout=10.0, **ENGINE)
    try:
        prompts = _prompts(llm.model_config.vocab_size)
        outputs = llm.generate(prompts, PARAMS)
        runner = llm.engine.runner
        assert (runner.tp.world, runner.cp.group.world, llm.context_parallel) == (2, 2, 2)
        # 37 + 50 + the 150-token prompt's three chunks split; the 3-token prompt and decode do not
        assert runner.cp.steps >= 2 and runner.cp.split_tokens == 37 + 50 + 150
        assert_same_outputs(outputs, reference)
        again = llm.generate(prompts[2:3], AGAIN)   # from its cached prefix, pointed on rank 0's group
        assert llm.engine.scheduler.cache.hit >= 48 and again[0].token_ids == ref_again[0].token_ids
        worker = runner.tp.processes[1]   # rank 2: tensor-parallel rank 0 of context-parallel rank 1
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(CPError) as e:   # a fresh 40-token prompt splits: rank 2 is needed
            llm.generate([list(range(1, 41))], AGAIN)
        assert time.monotonic() - start < 60
        assert "\n" not in str(e.value) and "tensor- and context-parallel group of 4" in str(e.value)
        assert all(p.exitcode is not None for p in runner.tp.processes)
        with pytest.raises(CPError):   # no rank can run without the others' shards
            llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1))
    finally:
        llm.shutdown()


TORCHRUN_SCRIPT = """
import json
import torch
from compiled import LLM, SamplingParams
params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=-1)
llm = LLM(None, tensor_parallel_size=2, context_parallel_size=2, **{engine!r})
out = llm.generate({prompts!r}, params)
torch.save([(o.token_ids, o.prompt_logprobs) for o in out], {path!r})
runner = llm.engine.runner
print("RESULT " + json.dumps({{"tp": runner.tp.world, "cp": runner.cp.group.world, "steps": runner.cp.steps}}))
llm.shutdown()
"""


def test_torchrun_ranks_form_tp_2_by_cp_2_on_the_demo_moe(tmp_path):
    prompts, reference, _ = _reference(None)
    path = str(tmp_path / "outputs.pt")
    result = torchrun_result(tmp_path, TORCHRUN_SCRIPT.format(engine=ENGINE, prompts=prompts, path=path), nproc=4)
    assert (result["tp"], result["cp"]) == (2, 2) and result["steps"] >= 2
    outputs = [SimpleNamespace(token_ids=t, prompt_logprobs=p) for t, p in torch.load(path)]
    assert_same_outputs(outputs, reference)


def test_more_processes_than_visible_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # a host of three GPUs, for the check alone
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(ConfigError, match="^tensor_parallel_size=2 x context_parallel_size=2: only 3 GPU\\(s\\) "
                                          "are visible, one per process is needed$"):
        LLM(None, device="cuda", tensor_parallel_size=2, context_parallel_size=2, **ENGINE)
