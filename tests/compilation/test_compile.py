"""The compiled path on CPU (Inductor's C++ backend, no CUDA graphs) on the demo MoE model: HF parity,
greedy tokens equal to eager, no recompilation while serving, artifacts that load without Inductor."""

from __future__ import annotations

import json
import random

import pytest
import torch

from compiled import LLM, SamplingParams
from compiled.compilation.artifact import ArtifactError
from compiled.passes.manager import DEFAULT_PASSES, pass_hashes
from compiled.compilation.inductor import COMPILES
from tests.conftest import make_checkpoint
from tests.graphs.test_hf_parity import assert_prompt_logprobs_match, random_prompts
from tests.conftest import hf_model

@pytest.fixture(scope="module")
def ckpt():
    from compiled.demo import MOE_MODEL
    return MOE_MODEL


@pytest.fixture(scope="module")
def compiled_llm(ckpt):
    return LLM(ckpt, device="cpu", dtype="float32", compile=True, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def artifact(compiled_llm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("artifact")
    compiled_llm.export_artifact(str(folder))
    return str(folder)


def test_compiled_matches_hf(compiled_llm, ckpt):
    assert compiled_llm.build_report.unique_pieces < compiled_llm.build_report.pieces
    from compiled.demo import EXAMPLE_PROMPTS
    hf = hf_model(ckpt)
    outs = compiled_llm.generate(EXAMPLE_PROMPTS, SamplingParams(max_new_tokens=4, prompt_logprobs=-1))
    for out in outs:
        with torch.no_grad():
            logits = hf(torch.tensor([out.prompt_token_ids])).logits[0].float()
        assert_prompt_logprobs_match(out, torch.log_softmax(logits, -1))
    greedy = SamplingParams(max_new_tokens=64, temperature=0.0)
    eager = LLM(ckpt, device="cpu", dtype="float32")
    assert [o.token_ids for o in compiled_llm.generate(EXAMPLE_PROMPTS, greedy)] == \
        [o.token_ids for o in eager.generate(EXAMPLE_PROMPTS, greedy)]


def test_no_recompilation_over_200_batch_sizes(compiled_llm):
    from torch._dynamo.utils import counters
    before = COMPILES["count"], sum(counters["inductor"].values())
    rng = random.Random(0)
    vocab = compiled_llm.model_config.vocab_size
    for _ in range(200):
        size = rng.randint(1, 60)
        compiled_llm.generate([[rng.randrange(vocab) for _ in range(size)]],
                              SamplingParams(max_new_tokens=1, ignore_eos=True))
    assert (COMPILES["count"], sum(counters["inductor"].values())) == before


def test_artifact_loads_without_inductor(ckpt, artifact, compiled_llm):
    before = COMPILES["count"]
    warm = LLM(ckpt, device="cpu", dtype="float32", artifact=artifact, max_num_batched_tokens=64)
    assert COMPILES["count"] == before and warm.build_report.compiled_now == 0
    assert {"inductor_import", "artifact_load", "split", "compile"} <= set(warm.startup_seconds)
    assert min(warm.startup_seconds.values()) >= 0   # the stages still add up (compile keeps the rest)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(warm.model_config.vocab_size, [3, 17])
    assert [o.token_ids for o in warm.generate(prompts, params)] == \
        [o.token_ids for o in compiled_llm.generate(prompts, params)]


def test_artifact_for_other_model_config(tmp_path, artifact):
    other = make_checkpoint(tmp_path, moe=True)
    with pytest.raises(ArtifactError, match="model_config is"):
        LLM(other, device="cpu", dtype="float32", artifact=artifact)


def test_artifact_for_other_pass_list(ckpt, artifact):
    with pytest.raises(ArtifactError, match="passes is"):
        LLM(ckpt, device="cpu", dtype="float32", artifact=artifact, passes=["fuse_qkv"])


def test_artifact_manifest_records_versions(artifact):
    with open(f"{artifact}/manifest.json") as f:
        manifest = json.load(f)
    assert manifest["torch"] == torch.__version__ and manifest["device"] == "cpu"
    assert list(manifest["passes"]) == list(DEFAULT_PASSES) and manifest["pieces"]
    assert manifest["passes"] == pass_hashes(DEFAULT_PASSES)
    assert manifest["splitting_ops"] == ["compiled::attention"]
