"""Prompt logprobs of the engine against log_softmax of HF transformers' logits (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from compiled import LLM, SamplingParams
from tests.conftest import hf_model, make_checkpoint

CONFIGS = {
    "mqa_headdim_tied_vocab123": dict(moe=False, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True),
    "gqa8to1_bias": dict(moe=False, num_attention_heads=16, num_key_value_heads=2, head_dim=8,
                          attention_bias=True, vocab_size=200),
    "moe_mixed_no_norm_topk": dict(moe=True, mlp_only_layers=[1], num_hidden_layers=3, norm_topk_prob=False),
    "moe_sparse_step2_tied_gqa4": dict(moe=True, decoder_sparse_step=2, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
                                       vocab_size=250, num_experts=16, num_experts_per_tok=4),
}


def random_prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_generate_matches_hf(llm, hf, prompts: list[list[int]], new_tokens: int) -> None:
    """The engine's prompt logprobs over the whole vocabulary (within 1e-4) and greedy tokens
    against HF model `hf` on the same prompts."""
    from compiled import SamplingParams
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, prompt_logprobs=-1, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, sampling)):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0].float()
            greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False)[0]
        assert_prompt_logprobs_match(out, torch.log_softmax(logits, -1))
        assert out.token_ids == greedy[len(prompt):].tolist()


def assert_prompt_logprobs_match(out, ref_logprobs: torch.Tensor, tol: float = 1e-4) -> None:
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    worst = 0.0
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        ids = torch.tensor(list(entry.keys()))
        ours = torch.tensor(list(entry.values()))
        worst = max(worst, (ours - ref_logprobs[pos - 1, ids]).abs().max().item())
        assert out.prompt_token_ids[pos] in entry
    assert worst <= tol, f"max abs error {worst}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompt_logprobs_match_hf(tmp_path, name):
    overrides = dict(CONFIGS[name])
    moe = overrides.pop("moe")
    path = make_checkpoint(tmp_path, moe=moe, **overrides)
    hf = hf_model(path)
    # A small step budget forces chunked prefill, so later chunks attend over a cached prefix.
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=48)
    prompts = random_prompts(hf.config.vocab_size, [1, 5, 17, 40, 64])
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=1, prompt_logprobs=-1))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0].float()
        assert_prompt_logprobs_match(out, torch.log_softmax(logits, dim=-1))
