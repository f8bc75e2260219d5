"""Scale recipes of the fused graph: fused qkv / w13 scales concatenated along the output dim
where every member starts on a block boundary, the rest listed to be loaded dequantized."""

from __future__ import annotations

import pytest

from compiled.graphs.config import ModelConfig
from compiled.graphs.trace import meta_model, trace
from compiled.passes.manager import run_passes
from compiled.quant.config import QuantConfig
from compiled.quant.recipes import scale_recipes
from tests.conftest import MOE

ATTN = "model.layers.0.self_attn"


def _fused_weights(**overrides):
    cfg = ModelConfig.from_dict(dict(MOE, architectures=["Qwen3MoeForCausalLM"], **overrides))
    meta = meta_model(cfg)
    return run_passes(trace(meta), meta.checkpoint_map(), ["fuse_qkv", "fuse_w13"]).weights


def test_aligned_block_concatenates_scales_along_the_output_dim():
    recipes = scale_recipes(_fused_weights(), QuantConfig("fp8", "block", (16, 24)))
    qkv = recipes.scales.pieces[f"{ATTN}.qkv_proj.weight_scale"]
    assert [(p.source.rpartition(".")[0].rpartition(".")[2], p.row, p.shape) for p in qkv] == [
        ("q_proj", 0, (4, 3)), ("k_proj", 4, (2, 3)), ("v_proj", 6, (2, 3))]
    assert recipes.shapes[f"{ATTN}.qkv_proj.weight_scale"] == (8, 3)
    w13 = recipes.scales.pieces["model.layers.1.mlp.w13_scale"]
    assert len(w13) == 2 * MOE["num_experts"] and {p.row for p in w13} == {0, 2}
    assert recipes.shapes["model.layers.1.mlp.w13_scale"] == (MOE["num_experts"], 4, 3)
    assert recipes.shapes["model.layers.1.mlp.w2_scale"] == (MOE["num_experts"], 4, 2)
    assert not recipes.dequantized
    for name in recipes.scales.pieces:
        assert "embed" not in name and "lm_head" not in name and ".mlp.gate." not in name and "norm" not in name


def test_a_member_inside_a_block_leaves_its_parameter_dequantized():
    recipes = scale_recipes(_fused_weights(), QuantConfig("fp8", "block", (128, 128)))
    assert f"{ATTN}.qkv_proj.weight_scale" not in recipes.scales.pieces
    assert {f"{ATTN}.{p}_proj.weight" for p in "qkv"} <= recipes.dequantized
    assert recipes.shapes[f"{ATTN}.o_proj.weight_scale"] == (1, 1)            # one partial block
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in recipes.dequantized   # 32-row gate, 128 block
    assert recipes.shapes["model.layers.0.mlp.w2_scale"] == (MOE["num_experts"], 1, 1)


@pytest.mark.parametrize("scheme", ["channel", "tensor"])
def test_channel_scales_always_fuse_tensor_scales_only_alone(scheme):
    recipes = scale_recipes(_fused_weights(), QuantConfig("compressed-tensors", scheme))
    fused = f"{ATTN}.qkv_proj.weight_scale"
    if scheme == "channel":
        assert recipes.shapes[fused] == (64 + 32 + 32, 1) and not recipes.dequantized
    else:
        assert fused not in recipes.scales.pieces and recipes.shapes[f"{ATTN}.o_proj.weight_scale"] == (1, 1)
        assert recipes.shapes["model.layers.0.mlp.w2_scale"] == (MOE["num_experts"], 1, 1)
