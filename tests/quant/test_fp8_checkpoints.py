"""FP8 checkpoints on CPU equal HF transformers holding the dequantized weights: block FP8 with
bf16 and fp32 scales at block 128 (every block partial) and a smaller block (several per weight,
partial last ones), compressed-tensors per channel and per tensor (and with static activation and
KV cache scales, which load checked and unused), dense and MoE."""

from __future__ import annotations

import pytest
import torch

from compiled import LLM, SamplingParams
from tests.conftest import DENSE, hf_model, make_checkpoint
from tests.graphs.test_hf_parity import assert_generate_matches_hf, assert_prompt_logprobs_match, random_prompts
from tests.quant.checkpoints import BLOCK_FP8, compressed_tensors, quantize_checkpoint

CASES = {
    "block128-bf16-scales-moe": (True, BLOCK_FP8, torch.bfloat16),
    "block24x40-fp32-scales-moe": (True, dict(BLOCK_FP8, weight_block_size=[24, 40]), torch.float32),
    "block24x40-bf16-scales-dense": (False, dict(BLOCK_FP8, weight_block_size=[24, 40]), torch.bfloat16),
    "block16x40-fp32-scales-moe": (True, dict(BLOCK_FP8, weight_block_size=[16, 40]), torch.float32),
    "block128-fp32-scales-dense": (False, BLOCK_FP8, torch.float32),
    "compressed-channel-dense": (False, compressed_tensors(ignore=["lm_head", "re:.*layers\\.1\\.self_attn\\.o_proj$"]),
                                 torch.float32),
    "compressed-channel-moe": (True, compressed_tensors(ignore=["lm_head", "re:.*mlp\\.gate$"]), torch.bfloat16),
    "compressed-tensor-dense": (False, compressed_tensors("tensor"), torch.float32),
    "block24x40-static-dense": (False, dict(BLOCK_FP8, weight_block_size=[24, 40], activation_scheme="static"),
                                torch.float32),
    "compressed-channel-static-kv-moe": (True, compressed_tensors(ignore=["lm_head", "re:.*mlp\\.gate$"], static=True,
                                                                 kv=True), torch.float32),
}

FULLY_FP8 = ("block16x40-fp32-scales-moe", "compressed-channel-dense", "compressed-channel-moe")


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_checkpoint_matches_the_dequantized_model(tmp_path, case, one_intra_op_thread):
    moe, quant_config, scale_dtype = CASES[case]
    src = make_checkpoint(tmp_path / "src", moe=moe)
    path, reference = quantize_checkpoint(src, tmp_path / "fp8", tmp_path / "dequantized", quant_config, scale_dtype)
    llm = LLM(path, device="cpu", dtype="float32")
    params = dict(llm.model.named_parameters())
    fp8 = {n for n, p in params.items() if p.dtype == torch.float8_e4m3fn}
    assert fp8 and all(f"{n}_scale" in params for n in fp8), "FP8 weights stay FP8 beside their scales"
    if case in FULLY_FP8:   # every fused member starts on a block boundary: its parameter stays FP8
        assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.w2" if moe else
                "model.layers.1.mlp.down_proj.weight"} <= fp8, sorted(fp8)
    hf = hf_model(reference)
    assert_generate_matches_hf(llm, hf, random_prompts(DENSE["vocab_size"], [9, 14]), 6)


def test_eager_module_loads_an_fp8_checkpoint_dequantized(tmp_path, one_intra_op_thread):
    """Without the graph (enforce_eager, no LoRA) there is no fp8_weights pass: every FP8 weight
    loads dequantized into the plain module, with the same outputs."""
    src = make_checkpoint(tmp_path / "src", moe=True)
    path, reference = quantize_checkpoint(src, tmp_path / "fp8", tmp_path / "ref",
                                          dict(BLOCK_FP8, weight_block_size=[16, 40]))
    llm = LLM(path, device="cpu", dtype="float32", enforce_eager=True)
    assert all(p.dtype == torch.float32 for p in llm.model.parameters())
    prompt = random_prompts(DENSE["vocab_size"], [10])[0]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=1, prompt_logprobs=-1))[0]
    with torch.no_grad():
        logits = hf_model(reference)(torch.tensor([prompt])).logits[0].float()
    assert_prompt_logprobs_match(out, torch.log_softmax(logits, -1))
