"""GPU (bf16) versions of the parity tests; skipped without CUDA. Run with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from compiled import LLM, SamplingParams
from tests.conftest import make_checkpoint
from tests.graphs.test_hf_parity import CONFIGS, random_prompts

pytestmark = pytest.mark.gpu


def _hf_logprobs(path: str, prompt: list[int], dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device="cuda")).logits[0].float()
    return torch.log_softmax(logits, -1).cpu()


def _ours_logprobs(out) -> torch.Tensor:
    rows = [torch.tensor([entry[t] for t in sorted(entry)]) for entry in out.prompt_logprobs[1:]]
    return torch.stack(rows)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_prompt_logprobs_track_hf(tmp_path, name):
    """bf16 error against the fp32 oracle is no worse than HF's own bf16 error (plus slack)."""
    overrides = dict(CONFIGS[name])
    moe = overrides.pop("moe")
    path = make_checkpoint(tmp_path, moe=moe, **overrides)
    llm = LLM(path, device="cuda", dtype="bfloat16", max_num_batched_tokens=48)
    prompts = random_prompts(llm.model_config.vocab_size, [3, 29, 64])
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=1, prompt_logprobs=-1))
    for prompt, out in zip(prompts, outs):
        oracle = _hf_logprobs(path, prompt, torch.float32)[:-1]
        peer = _hf_logprobs(path, prompt, torch.bfloat16)[:-1]
        ours = _ours_logprobs(out)
        ours_err = (ours - oracle).abs().max().item()
        peer_err = (peer - oracle).abs().max().item()
        print(f"{name} len={len(prompt)} ours={ours_err:.4f} hf_bf16={peer_err:.4f}")
        assert ours_err <= 1.5 * peer_err + 0.02
