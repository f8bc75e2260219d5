"""LoRA on an FP8 base: adapters stay in the engine dtype, and a mixed batch equals each adapter
merged into the dequantized weights (HF transformers, CPU, fp32)."""

from __future__ import annotations

import torch

import pytest

from compiled import LLM, SamplingParams
from compiled.errors import ConfigError
from compiled.graphs.config import ModelConfig
from compiled.lora.adapter import load_adapter
from compiled.lora.merge import merge_into
from tests.conftest import MOE, hf_model, make_checkpoint
from tests.graphs.test_hf_parity import assert_prompt_logprobs_match, random_prompts
from tests.lora.test_adapter import ATTN, MLP, make_peft_adapter, per_expert_tensors, write_adapter
from tests.quant.checkpoints import BLOCK_FP8, quantize_checkpoint


@torch.no_grad()
def _oracle(reference: str, adapter: str | None, prompt: list[int], new_tokens: int):
    """(prompt logprobs, greedy continuation) of HF on the dequantized weights, the adapter merged."""
    model = hf_model(reference)
    if adapter is not None:
        merge_into(model, load_adapter("oracle", adapter, ModelConfig.from_pretrained(reference), 64))
    ids = torch.tensor([prompt])
    greedy = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0]
    return torch.log_softmax(model(ids).logits[0].float(), -1), greedy[len(prompt):].tolist()


def fp8_params(llm) -> set[str]:
    """The engine's parameters held in float8_e4m3fn."""
    return {n for n, p in llm.model.named_parameters() if p.dtype == torch.float8_e4m3fn}


def mixed_adapters(path: str, reference: str, root) -> dict[str, str]:
    """Two adapters of the FP8 MoE at `path` (written under `root`): attention + dense MLP in
    PEFT's layout, and the experts in the per-expert layout."""
    return {
        "attn_mlp": make_peft_adapter(reference, root / "a1", seed=1, r=8, lora_alpha=16, target_modules=ATTN + MLP),
        "experts": write_adapter(root / "a2", per_expert_tensors(ModelConfig.from_pretrained(path), 4, seed=2),
                                 r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    }


def assert_mixed_batch_matches_merged(llm, reference: str, adapters: dict[str, str]) -> None:
    """A batch of base rows and both adapters: each row's prompt logprobs and greedy tokens those
    of HF on the dequantized weights with its adapter merged."""
    names = [None, "attn_mlp", "experts", "attn_mlp"]
    prompts = random_prompts(MOE["vocab_size"], [9, 12, 7, 10])
    params = SamplingParams(max_new_tokens=4, temperature=0.0, prompt_logprobs=-1, ignore_eos=True)
    for prompt, name, out in zip(prompts, names, llm.generate(prompts, params, lora=names)):
        logprobs, greedy = _oracle(reference, adapters.get(name), prompt, 4)
        assert_prompt_logprobs_match(out, logprobs)
        assert out.token_ids == greedy, name


def test_mixed_adapter_batch_on_an_fp8_moe_base(tmp_path, one_intra_op_thread):
    src = make_checkpoint(tmp_path / "src", moe=True)
    path, reference = quantize_checkpoint(src, tmp_path / "fp8", tmp_path / "ref",
                                          dict(BLOCK_FP8, weight_block_size=[16, 40]), torch.bfloat16)
    adapters = mixed_adapters(path, reference, tmp_path)
    llm = LLM(path, device="cpu", dtype="float32", lora_modules=adapters, max_loras_per_batch=2)
    fp8 = fp8_params(llm)
    assert {"model.layers.0.mlp.w13", "model.layers.1.self_attn.qkv_proj.weight"} <= fp8, sorted(fp8)
    assert_mixed_batch_matches_merged(llm, reference, adapters)


def test_merge_lora_is_refused_on_fp8_weights(tmp_path):
    src = make_checkpoint(tmp_path / "src")
    with pytest.raises(ConfigError, match="merge_lora=True: FP8 weights cannot hold a merged adapter"):
        LLM(src, device="cpu", quantization="fp8", merge_lora=True,
            lora_modules={"a": make_peft_adapter(src, tmp_path / "a", r=4, target_modules=ATTN)})
