"""Broken FP8 checkpoints: each a one-line error naming the tensor or field at fault."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from compiled import LLM
from compiled.errors import CheckpointError, ConfigError
from tests.conftest import make_checkpoint
from tests.quant.checkpoints import BLOCK_FP8, compressed_tensors, quantize_checkpoint

SCALE = "model.layers.1.self_attn.k_proj.weight_scale_inv"


# Block 16x32 keeps the fused qkv FP8 (its scale is a parameter the loader checks); at 128 the
# 32-row k_proj sits inside q's block, so qkv loads dequantized (the scale is checked there).
@pytest.fixture(params=[[16, 32], [128, 128]], ids=["fp8-parameter", "dequantized"])
def fp8_path(tmp_path, request) -> str:
    src = make_checkpoint(tmp_path / "src")
    return quantize_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", dict(BLOCK_FP8, weight_block_size=request.param))[0]


def _edit(path: str, edit) -> str:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)
    return file


def _error(path: str, kind: type) -> str:
    with pytest.raises(kind) as e:
        LLM(path, device="cpu", dtype="float32")
    message = str(e.value)
    assert "\n" not in message
    return message


def test_missing_scale(fp8_path):
    file = _edit(fp8_path, lambda t: t.pop(SCALE))
    assert _error(fp8_path, CheckpointError) in (
        f"{file}: missing tensor '{SCALE}' (the scale of float8 weight 'model.layers.1.self_attn.k_proj.weight')",
        f"{fp8_path}: checkpoint is missing tensor '{SCALE}'")


def test_mis_shaped_scale(fp8_path):
    def edit(t):
        t[SCALE] = torch.ones(3, 3)
    file = _edit(fp8_path, edit)
    expected = [2, 2] if "16" in json.dumps(_quant(fp8_path)["weight_block_size"]) else [1, 1]
    assert _error(fp8_path, CheckpointError) in (
        f"{file}: tensor '{SCALE}' has shape [3, 3] and dtype torch.float32, expected {expected} floats for weight [32, 64]",
        f"{file}: tensor '{SCALE}' has shape [3, 3], expected {expected}")


def _quant(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["quantization_config"]


def test_quantized_weight_stored_unquantized(fp8_path):
    def edit(t):
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"].float()
    file = _edit(fp8_path, edit)
    assert _error(fp8_path, CheckpointError) == (
        f"{file}: tensor 'model.layers.0.mlp.down_proj.weight' has dtype torch.float32, expected float8_e4m3fn "
        f"(quantization_config quantizes 'model.layers.0.mlp.down_proj')")


def test_float8_where_the_config_quantizes_nothing(fp8_path):
    def edit(t):
        t["lm_head.weight"] = t["lm_head.weight"].to(torch.float8_e4m3fn)
    file = _edit(fp8_path, edit)
    assert _error(fp8_path, CheckpointError) == (
        f"{file}: tensor 'lm_head.weight' is torch.float8_e4m3fn but quantization_config leaves 'lm_head' unquantized")


def test_float8_tensors_without_a_quantization_config(fp8_path):
    config = os.path.join(fp8_path, "config.json")
    with open(config) as f:
        raw = json.load(f)
    del raw["quantization_config"]
    with open(config, "w") as f:
        json.dump(raw, f)
    message = _error(fp8_path, ConfigError)
    assert message.endswith("but config.json has no 'quantization_config'")
    assert "is torch.float8_e4m3fn" in message or "is an FP8 weight scale" in message
    assert "model.layers." in message and message.startswith(os.path.join(fp8_path, "model.safetensors"))


def test_unknown_quant_method(fp8_path):
    config = os.path.join(fp8_path, "config.json")
    with open(config) as f:
        raw = json.load(f)
    raw["quantization_config"]["quant_method"] = "gptq"
    with open(config, "w") as f:
        json.dump(raw, f)
    assert _error(fp8_path, ConfigError) == (
        f"{config}: field 'quantization_config.quant_method' is 'gptq' (supported: fp8, compressed-tensors)")


INPUT_SCALE = "model.layers.1.mlp.up_proj.input_scale"


@pytest.fixture
def static_path(tmp_path) -> str:
    src = make_checkpoint(tmp_path / "src")
    return quantize_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", compressed_tensors(static=True, kv=True))[0]


def test_static_activations_missing_an_input_scale(static_path):
    file = _edit(static_path, lambda t: t.pop(INPUT_SCALE))
    assert _error(static_path, CheckpointError) == (
        f"{file}: missing tensor '{INPUT_SCALE}' (quantization_config's activations are static)")


@pytest.mark.parametrize("bad, got", [(torch.ones(2), "shape [2] dtype torch.float32"), (torch.tensor([-0.5]), "-0.5"),
                                      (torch.tensor([float("nan")]), "nan")])
def test_static_activations_bad_input_scale(static_path, bad, got):
    def edit(t):
        t[INPUT_SCALE] = bad
    file = _edit(static_path, edit)
    assert _error(static_path, CheckpointError) == (
        f"{file}: tensor '{INPUT_SCALE}' must be one positive float (a static per-tensor activation scale), got {got}")


def test_input_scale_where_activations_are_dynamic(fp8_path):
    def edit(t):
        t[INPUT_SCALE] = torch.ones(1)
    file = _edit(fp8_path, edit)
    assert _error(fp8_path, CheckpointError) == f"{file}: unexpected tensor '{INPUT_SCALE}'"


def test_kv_cache_scale_not_positive(static_path):
    def edit(t):
        t["model.layers.0.self_attn.v_scale"] = torch.tensor(0.0)
    file = _edit(static_path, edit)
    assert _error(static_path, CheckpointError) == (
        f"{file}: tensor 'model.layers.0.self_attn.v_scale' must be one positive float (a per-tensor KV cache scale), "
        f"got 0.0")
