"""FP8 under tensor parallelism (CPU, gloo, fp32): TP=2 ranks whose slices start inside scale
blocks equal HF transformers holding the dequantized weights (prompt logprobs over the whole
vocabulary within 1e-4, greedy tokens identical): block FP8 on a dense model (block 128, partial
edge blocks; quantized at load too) and on a MoE with a dense layer (the expert slices cross
block boundaries), with a batch mixing LoRA adapters and base rows; compressed-tensors per channel."""

from __future__ import annotations

import torch

from compiled import LLM
from tests.conftest import DENSE, hf_model, make_checkpoint
from tests.graphs.test_hf_parity import assert_generate_matches_hf, random_prompts
from tests.quant.checkpoints import BLOCK_FP8, compressed_tensors, quantize_checkpoint
from tests.quant.test_fp8_lora import assert_mixed_batch_matches_merged, fp8_params, mixed_adapters

ENGINE = dict(device="cpu", dtype="float32", tensor_parallel_size=2, max_model_len=128, kv_cache_tokens=1024)
# 48 expert rows a rank: rank 1's gate and up slices start at row 24 of a 32-row block
MOE = dict(moe=True, moe_intermediate_size=48, num_hidden_layers=3, mlp_only_layers=[1])


def _generate_matches_hf(path: str, reference: str, **kwargs) -> set[str]:
    llm = LLM(path, **ENGINE, **kwargs)
    try:
        assert_generate_matches_hf(llm, hf_model(reference), random_prompts(DENSE["vocab_size"], [9, 14]), 5)
        return fp8_params(llm)
    finally:
        llm.shutdown()


def test_block_fp8_dense_checkpoint_and_quantized_at_load(tmp_path, one_intra_op_thread):
    # 160 MLP rows / columns a rank: rank 1's start inside the second 128 block, its end in a partial third
    src = make_checkpoint(tmp_path / "src", intermediate_size=320)
    path, reference = quantize_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", BLOCK_FP8)
    layer = {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.w13.weight",
             "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"}
    assert layer <= _generate_matches_hf(path, reference)
    assert layer <= _generate_matches_hf(src, reference, quantization="fp8")


def test_compressed_tensors_per_channel_moe(tmp_path, one_intra_op_thread):
    src = make_checkpoint(tmp_path / "src", **MOE)
    path, reference = quantize_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", compressed_tensors())
    assert {"model.layers.0.mlp.w13", "model.layers.0.mlp.w2", "model.layers.1.mlp.down_proj.weight"} \
        <= _generate_matches_hf(path, reference)


def test_block_fp8_moe_with_a_batch_mixing_lora_adapters(tmp_path, one_intra_op_thread):
    src = make_checkpoint(tmp_path / "src", **MOE)
    path, reference = quantize_checkpoint(src, tmp_path / "fp8", tmp_path / "ref",
                                          dict(BLOCK_FP8, weight_block_size=[32, 40]), torch.bfloat16)
    adapters = mixed_adapters(path, reference, tmp_path)
    llm = LLM(path, **ENGINE, lora_modules=adapters, max_loras_per_batch=2)
    try:
        assert {"model.layers.0.mlp.w13", "model.layers.2.mlp.w2", "model.layers.1.mlp.w13.weight"} <= fp8_params(llm)
        assert_mixed_batch_matches_merged(llm, reference, adapters)
    finally:
        llm.shutdown()
