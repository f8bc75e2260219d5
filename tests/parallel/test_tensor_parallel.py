"""Tensor parallelism on CPU (gloo, fp32): TP=2 and TP=4 give the prompt logprobs (whole
vocabulary) and greedy tokens of TP=1 for one batch of prompts of odd lengths: on a dense model
whose K/V heads are replicated at TP=4 (2 of them) and whose vocabulary (123) divides by neither
2 nor 4 (padded vocab-parallel shards), on a MoE with a dense layer among its MoE layers (TP=2,
and TP=4 with expert parallelism), and on the demo dense model, whose LM head is tied to its
embedding. Prefix-cache hits and chunked prefill ride along (the 150-token prompt is prefilled in
chunks; the repeated prompt starts from its cached prefix). A batch mixing LoRA adapters
(attention-only, experts in PEFT's fused layout, experts per expert) and base rows runs under TP
and under TP+EP."""

from __future__ import annotations

import os

import pytest
import torch

from compiled import LLM, SamplingParams
from compiled.errors import ConfigError
from tests.conftest import assert_same_outputs, make_checkpoint

ENGINE = dict(max_num_batched_tokens=64, kv_cache_tokens=2048, max_model_len=256, enable_prefix_caching=True,
              logits_chunk=40)   # a 64-token chunk's prompt logprobs in two pieces, joined by every rank
LENGTHS = (37, 3, 50, 150)
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=-1)


def _prompts(vocab: int) -> list[list[int]]:
    # the ids reach the vocabulary's last (the last shard's) rows
    return [[(7 * i + 3 * n) % (vocab - 1) + 1 for i in range(n)] for n in LENGTHS]


def _run(model: str, world: int, expert_parallel: bool = False):
    llm = LLM(model, tensor_parallel_size=world, enable_expert_parallel=expert_parallel, **ENGINE)
    try:
        # a tokenizer may know fewer ids than the vocabulary has rows (the demo's)
        prompts = _prompts(len(llm.tokenizer) if llm.tokenizer is not None else llm.model_config.vocab_size)
        first = llm.generate(prompts, PARAMS)
        vocab = llm.model_config.vocab_size   # every position's logprobs cover the whole vocabulary
        assert all(len(entry) == vocab for out in first for entry in out.prompt_logprobs[1:])
        again = llm.generate(prompts[2:3], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
        assert llm.engine.num_overlapped > 0   # decode steps whose input ids the workers got from the device
        assert llm.engine.scheduler.cache.hit >= 48   # the repeated prompt's cached K/V, pointed on every rank
    finally:
        llm.shutdown()
    return first, again


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from compiled.demo import DENSE_MODEL
    root = tmp_path_factory.mktemp("tp")
    return {"dense": make_checkpoint(root / "dense", seed=1, num_hidden_layers=2, vocab_size=123),
            "mixed": make_checkpoint(root / "mixed", moe=True, seed=2, num_hidden_layers=3, mlp_only_layers=[1]),
            "demo_dense": DENSE_MODEL}


@pytest.mark.parametrize("name, worlds", [("dense", ((2, False), (4, False))), ("mixed", ((2, False), (4, True))),
                                          ("demo_dense", ((2, False),))])
def test_tp_equals_tp_1(models, name, worlds, one_intra_op_thread):
    reference, ref_again = _run(models[name], 1)
    for world, expert_parallel in worlds:
        outputs, again = _run(models[name], world, expert_parallel)
        assert_same_outputs(outputs, reference)
        assert again[0].token_ids == ref_again[0].token_ids


def _config_only(folder, model: str, **changes) -> str:
    """A folder with only `model`'s config.json, changed (enough for the checks made before
    anything loads)."""
    import json
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(cfg, **changes), f)
    return str(folder)


def test_tp_refuses_what_it_cannot_split(models, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        LLM(models["dense"], tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ConfigError, match="merge_lora=True: expected False with tensor_parallel_size > 1"):
        LLM(models["dense"], tensor_parallel_size=2, merge_lora=True, **ENGINE)
    six = _config_only(tmp_path / "six", models["mixed"], num_experts=6)
    with pytest.raises(ConfigError, match="^tensor_parallel_size=4 with enable_expert_parallel does not divide "
                                          "num_experts=6$"):
        LLM(six, tensor_parallel_size=4, enable_expert_parallel=True, **ENGINE)
    narrow = _config_only(tmp_path / "narrow", models["mixed"], moe_intermediate_size=30)
    with pytest.raises(ConfigError, match="^tensor_parallel_size=4 does not divide moe_intermediate_size=30$"):
        LLM(narrow, tensor_parallel_size=4, **ENGINE)
    with pytest.raises(ConfigError, match="enable_expert_parallel='yes': expected True or False"):
        LLM(narrow, tensor_parallel_size=4, enable_expert_parallel="yes", **ENGINE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # a host of two GPUs, for the check alone
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="^tensor_parallel_size=4: only 2 GPU\\(s\\) are visible, one per process"):
        LLM(models["dense"], device="cuda", tensor_parallel_size=4, **ENGINE)


def _per_expert_adapter(folder, cfg, seed: int = 5) -> str:
    """A LoRA of every expert's gate, up and down projections in the per-expert layout
    (`mlp.experts.{e}.{proj}`), random."""
    import json

    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    h, inter, r = cfg.hidden_size, cfg.moe_intermediate_size, 4
    tensors = {}
    for layer in (i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)):
        for e in range(cfg.num_experts):
            for proj, (i, o) in {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}.items():
                key = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, i, generator=g) * 0.2
                tensors[f"{key}.lora_B.weight"] = torch.randn(o, r, generator=g) * 0.2
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 8, "bias": "none",
                   "target_modules": ["gate_proj", "up_proj", "down_proj"]}, f)
    return str(folder)


def test_tp_and_ep_with_a_batch_mixing_lora_adapters_and_base_rows(tmp_path, one_intra_op_thread):
    """The demo MoE model's adapters ("first": attention; "upper": MLP and experts in PEFT's fused
    layout) and one of experts in the per-expert layout, with base rows, in one batch: TP=2
    (column-parallel B and row-parallel A sharded per rank) and TP=2 with expert parallelism (each
    rank holding its own experts' factors only) give TP=1's outputs."""
    from compiled.demo import MOE_ADAPTERS, MOE_MODEL
    from compiled.graphs.config import ModelConfig
    cfg = ModelConfig.from_pretrained(MOE_MODEL)
    modules = dict(MOE_ADAPTERS, per=_per_expert_adapter(tmp_path / "per", cfg))
    adapters = [None, "upper", "first", "per"]

    def run(world: int, expert_parallel: bool, *loras: list[str | None]):
        llm = LLM(None, tensor_parallel_size=world, enable_expert_parallel=expert_parallel, lora_modules=modules,
                  **ENGINE)
        try:
            held = {name: llm.engine.loras.adapters[name] for name in modules}
            return [llm.generate(_prompts(llm.model_config.vocab_size), PARAMS, lora=a) for a in loras], held
        finally:
            llm.shutdown()
    (reference,), held = run(1, False, adapters)
    assert {"q_proj", "o_proj"} <= held["first"].projections and {"gate_proj", "down_proj"} <= held["upper"].projections
    assert held["per"].projections == {"gate_proj", "up_proj", "down_proj"}
    (outputs, base), _ = run(2, False, adapters, [None] * len(adapters))
    assert_same_outputs(outputs, reference)
    for b, r, a in zip(base, reference, adapters):   # the adapters change their rows' logprobs
        gap = max(abs(x[k] - y[k]) for x, y in zip(b.prompt_logprobs[1:], r.prompt_logprobs[1:]) for k in x)
        assert (gap > 1e-2) == (a is not None)
    (outputs,), held = run(2, True, adapters)
    assert_same_outputs(outputs, reference)
    for name in ("upper", "per"):   # rank 0 holds experts 0-3 of 8, whole
        w = held[name].experts[(1, "down_proj")]
        assert w.a.shape[0] == w.b.shape[0] == 4 and w.a.shape[2] == cfg.moe_intermediate_size


def test_a_rank_killed_mid_generate_ends_it_with_a_one_line_error(models, monkeypatch):
    import os
    import signal
    import time

    from compiled.parallel.group import CPError
    from compiled.runtime.model_runner import ModelRunner
    llm = LLM(models["dense"], tensor_parallel_size=2, cp_timeout=5.0, **ENGINE)
    worker = llm.engine.runner.tp.processes[0]
    forward, steps = ModelRunner._forward, []

    def kill_after_two(self, *args):
        steps.append(1)
        if len(steps) == 3:
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(10)
        return forward(self, *args)

    monkeypatch.setattr(ModelRunner, "_forward", kill_after_two)
    start = time.monotonic()
    try:
        with pytest.raises(CPError) as e:
            llm.generate([list(range(1, 40))], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        assert time.monotonic() - start < 60
        assert "\n" not in str(e.value) and "tensor-parallel group of 2" in str(e.value)
        assert worker.exitcode is not None
        with pytest.raises(CPError):   # no rank can run without the others' shards
            llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1))
    finally:
        llm.shutdown()


TORCHRUN_SCRIPT = """
import json
from compiled import LLM, SamplingParams
llm = LLM(None, tensor_parallel_size=2, **{engine!r})
out = llm.generate([{prompt!r}], SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
print("RESULT " + json.dumps({{"tokens": out[0].token_ids, "world": llm.engine.runner.tp.world}}))
llm.shutdown()
"""


def test_torchrun_ranks_join_the_tensor_parallel_group(tmp_path):
    from tests.conftest import torchrun_result
    prompt = list(range(3, 40))
    result = torchrun_result(tmp_path, TORCHRUN_SCRIPT.format(engine=ENGINE, prompt=prompt))
    llm = LLM(None, **ENGINE)
    ref = llm.generate([prompt], SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert result["world"] == 2 and result["tokens"] == ref.token_ids


@pytest.mark.parametrize("failed", [False, True], ids=["healthy", "after-a-failure"])
def test_shutdown_frees_the_graphs_before_the_group(failed):
    """A graph that captured an NCCL all-reduce holds the communicator, whose teardown waits for it:
    a healthy shutdown frees every graph first. After a failure the GPU may still wait on the dead
    peer, so the graphs stay and the group's bounded teardown ends it."""
    from types import SimpleNamespace
    calls = []
    group = SimpleNamespace(world=2, shutdown=lambda message: calls.append(type(message).__name__))
    runner = SimpleNamespace(cp=None, tp=group, tp_failure="rank 1 exited with code 1" if failed else None,
                             release_graphs=lambda: calls.append("graphs"))
    llm = LLM.__new__(LLM)   # the state shutdown reads, without starting processes
    llm._cp, llm.engine, llm.config = group, SimpleNamespace(runner=runner), SimpleNamespace(tp=True)
    llm.shutdown()
    assert calls == (["Stop"] if failed else ["graphs", "Stop"])
    assert runner.tp_failure and llm._cp is None
