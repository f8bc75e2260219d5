"""quantization="fp8": an unquantized checkpoint becomes block FP8 while it loads, equal to HF
holding the quantized-then-dequantized weights; with dummy weights, FP8 in the real shapes."""

from __future__ import annotations

import os

import pytest
import torch

from compiled import LLM, SamplingParams
from compiled.errors import ConfigError
from tests.conftest import MOE, hf_model, make_checkpoint
from tests.graphs.test_hf_parity import assert_generate_matches_hf, random_prompts
from tests.quant.checkpoints import BLOCK_FP8, quantize_checkpoint


def _fp8_params(llm) -> set[str]:
    return {n for n, p in llm.model.named_parameters() if p.dtype == torch.float8_e4m3fn}


def test_quantize_at_load_matches_the_quantized_dequantized_model(tmp_path, one_intra_op_thread):
    src = make_checkpoint(tmp_path / "src", moe=True, dtype=torch.bfloat16)
    _, reference = quantize_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", BLOCK_FP8)
    llm = LLM(src, device="cpu", dtype="float32", quantization="fp8")
    assert "model.layers.0.self_attn.o_proj.weight" in _fp8_params(llm)   # one partial 128 block
    hf = hf_model(reference)
    assert_generate_matches_hf(llm, hf, random_prompts(MOE["vocab_size"], [11, 8]), 5)


def test_quantize_at_load_with_dummy_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "1")   # so that the test's end puts it back as it was
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE")
    make_checkpoint(tmp_path, moe=True, num_attention_heads=8, num_key_value_heads=8, head_dim=16,
                    hidden_size=128, moe_intermediate_size=128)
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy", quantization="fp8")
    fp8 = _fp8_params(llm)
    assert {"model.layers.0.mlp.w13", "model.layers.0.mlp.w2", "model.layers.1.self_attn.qkv_proj.weight"} <= fp8
    scale = dict(llm.model.named_parameters())["model.layers.0.mlp.w13_scale"]
    assert scale.shape == (MOE["num_experts"], 2, 1)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0].token_ids) == 4
    # FP8 weights: cuBLASLt's workspace asked away (its statically scheduled FP8 GEMMs), for this
    # process and its children
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "0"


def test_a_set_cublaslt_workspace_is_left_alone(monkeypatch):
    from compiled.linear import fp8_cublas
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "4096")
    fp8_cublas.prefer_static_schedules()
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "4096"
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE")
    fp8_cublas.prefer_static_schedules()
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == str(fp8_cublas.WORKSPACE_KIB)


def test_unknown_quantization_is_one_line(tmp_path):
    make_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="quantization") as e:
        LLM(str(tmp_path), device="cpu", quantization="int4")
    assert "\n" not in str(e.value)


def test_roofline_counts_fp8_bytes(tmp_path):
    from cli import roofline
    from compiled.graphs.config import ModelConfig
    from compiled.quant.at_load import METHODS
    from tests.conftest import reduced_real_config
    cfg = ModelConfig.from_pretrained(reduced_real_config(tmp_path, layers=48))
    bf16, fp8 = (roofline.decode_bytes(cfg, 1, 0, 2, quant) for quant in (None, METHODS["fp8"]))
    assert bf16.lm_head == fp8.lm_head and bf16.embedding_rows == fp8.embedding_rows
    assert fp8.bytes_per_expert == pytest.approx(bf16.bytes_per_expert / 2 * (1 + 4 / 128 ** 2))
    # the FP8 byte floor at batch 1 on an H200: about 0.78 ms
    assert 1e3 * fp8.floor_s(4.25e12) == pytest.approx(0.78, abs=0.03)


def test_demo_moe_quantized_at_load_keeps_its_greedy_tokens(one_intra_op_thread):
    """FP8's rounding on the trained demo model: its greedy outputs survive (the measure of the
    rounding, `bench/fp8_quality.py`, is in bench/RESULTS.md)."""
    from compiled.demo import MOE_MODEL
    prompts = ["count 95:", "copy Bird wax:", "COPY jam:", "count 31:"]
    sampling = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for quantization in (None, "fp8"):
        llm = LLM(MOE_MODEL, device="cpu", dtype="float32", quantization=quantization)
        outs[quantization] = [o.token_ids for o in llm.generate([llm.tokenizer.encode(p) for p in prompts], sampling)]
    same = sum(a == b for x, y in zip(outs[None], outs["fp8"]) for a, b in zip(x, y))
    assert same >= 0.9 * 16 * len(prompts), outs
