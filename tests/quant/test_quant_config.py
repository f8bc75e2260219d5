"""quantization_config parsing: both FP8 formats, which linears they quantize, and every bad field
as a one-line ConfigError naming it."""

from __future__ import annotations

import json

import pytest

from compiled.errors import ConfigError
from compiled.graphs.config import ModelConfig
from compiled.quant.config import QuantConfig
from tests.conftest import DENSE

BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def compressed(strategy: str = "channel", ignore=("lm_head", "re:.*mlp\\.gate$")) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def _config(tmp_path, quant) -> tuple[str, ModelConfig | None]:
    file = tmp_path / "config.json"
    file.write_text(json.dumps(dict(DENSE, model_type="qwen3", quantization_config=quant)))
    return str(file), ModelConfig.from_pretrained(str(file))


def test_block_fp8(tmp_path):
    _, cfg = _config(tmp_path, dict(BLOCK, weight_block_size=[128, 64]))
    q = cfg.quantization
    assert q == QuantConfig("fp8", "block", (128, 64)) and q.scale_suffix == "weight_scale_inv"
    assert q.scale_shape(300, 64) == (3, 1) and q.scale_shape(96, 65) == (1, 2)
    assert q.quantizes("model.layers.0.self_attn.q_proj")
    assert q.quantizes("model.layers.1.mlp.experts.7.down_proj")
    for module in ("model.layers.0.mlp.gate", "lm_head", "model.embed_tokens", "model.layers.0.input_layernorm"):
        assert not q.quantizes(module)
    hash(cfg)  # the config stays a frozen, hashable value


def test_compressed_tensors_per_channel_and_per_tensor(tmp_path):
    _, cfg = _config(tmp_path, compressed(ignore=["lm_head", "re:.*layers\\.1\\..*v_proj$", "o_proj"]))
    q = cfg.quantization
    assert (q.method, q.scheme, q.scale_suffix) == ("compressed-tensors", "channel", "weight_scale")
    assert q.scale_shape(96, 64) == (96, 1)
    assert q.quantizes("model.layers.0.self_attn.v_proj") and not q.quantizes("model.layers.1.self_attn.v_proj")
    assert not q.quantizes("model.layers.0.self_attn.o_proj")
    _, cfg = _config(tmp_path, compressed("tensor"))
    assert cfg.quantization.scheme == "tensor" and cfg.quantization.scale_shape(96, 64) == (1,)


def test_no_quantization_config(tmp_path):
    assert _config(tmp_path, None)[1].quantization is None


@pytest.mark.parametrize("quant, message", [
    (dict(BLOCK, quant_method="awq"), "field 'quantization_config.quant_method' is 'awq' (supported: fp8, compressed-tensors)"),
    (dict(BLOCK, fmt="e5m2"), "field 'quantization_config.fmt' is 'e5m2' (supported: 'e4m3')"),
    (dict(BLOCK, weight_block_size=[128]), "field 'quantization_config.weight_block_size' must be two positive ints, got [128]"),
    (dict(BLOCK, weight_block_size=[128, 0]), "field 'quantization_config.weight_block_size' must be two positive ints, got [128, 0]"),
    (dict(BLOCK, weight_block_size=[128, 1.5]), "field 'quantization_config.weight_block_size' must be two positive ints, got [128, 1.5]"),
    (dict(BLOCK, weight_block_size="128"), "field 'quantization_config.weight_block_size' must be two positive ints, got '128'"),
    (dict(BLOCK, activation_scheme="token"),
     "field 'quantization_config.activation_scheme' is 'token' (supported: 'dynamic', 'static')"),
    (dict(compressed(), format="pack-quantized"), "field 'quantization_config.format' is 'pack-quantized' (supported: 'float-quantized')"),
    (dict(compressed(), kv_cache_scheme={"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}),
     "field 'quantization_config.kv_cache_scheme' must be 8-bit float KV cache scales, got num_bits=8 type='int'"),
    (dict(compressed(), kv_cache_scheme="fp8"), "field 'quantization_config.kv_cache_scheme' must be an object or null, "
                                                "got 'fp8'"),
    ("fp8", "field 'quantization_config' must be an object, got 'fp8'"),
])
def test_bad_quantization_config_names_the_field(tmp_path, quant, message):
    file = tmp_path / "config.json"
    file.write_text(json.dumps(dict(DENSE, model_type="qwen3", quantization_config=quant)))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_pretrained(str(file))
    assert str(e.value) == f"{file}: {message}"


def test_compressed_tensors_int_weights_are_refused(tmp_path):
    quant = compressed()
    quant["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4)
    with pytest.raises(ConfigError, match="config_groups.group_0.weights' must be 8-bit float weights"):
        _config(tmp_path, quant)


# 8-bit float, one stored scale a tensor: a static activation scheme's args, and a kv_cache_scheme's
STATIC_TENSOR = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}


def _with_acts(acts, groups=("group_0",)) -> dict:
    quant = compressed()
    group = quant["config_groups"]["group_0"]
    quant["config_groups"] = {name: dict(group, input_activations=acts) for name in groups}
    return quant


def test_activation_schemes(tmp_path):
    assert _config(tmp_path, _with_acts(STATIC_TENSOR))[1].quantization.activation_scheme == "static"
    assert _config(tmp_path, _with_acts(None))[1].quantization.activation_scheme == "dynamic"   # weight-only
    assert _config(tmp_path, compressed())[1].quantization.activation_scheme == "dynamic"
    assert _config(tmp_path, dict(BLOCK, activation_scheme="static"))[1].quantization.activation_scheme == "static"
    assert _config(tmp_path, dict(compressed(), kv_cache_scheme=STATIC_TENSOR))[1].quantization.kv_cache_scales
    assert not _config(tmp_path, compressed())[1].quantization.kv_cache_scales


@pytest.mark.parametrize("acts, message", [
    ({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
     "input_activations' must be 8-bit float activations, got num_bits=8 type='int'"),
    ({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False},
     "input_activations.strategy' is 'token' with static scales (supported: 'tensor')"),
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": "local"},
     "input_activations.dynamic' must be true or false, got 'local'"),
    ("fp8", "input_activations' must be an object or null"),
])
def test_bad_input_activations_name_the_field(tmp_path, acts, message):
    with pytest.raises(ConfigError) as e:
        _config(tmp_path, _with_acts(acts))
    assert str(e.value).endswith(f"field 'quantization_config.config_groups.group_0.{message}") \
        and "\n" not in str(e.value), str(e.value)


def test_static_and_dynamic_groups_are_refused(tmp_path):
    quant = _with_acts(STATIC_TENSOR, ("a", "b"))
    quant["config_groups"]["b"] = dict(quant["config_groups"]["b"], input_activations=None)
    with pytest.raises(ConfigError, match="mixes static and dynamic input_activations$"):
        _config(tmp_path, quant)


def test_block_fp8_ignore_lists_of_either_name(tmp_path):
    quant = dict(BLOCK, modules_to_not_convert=["lm_head", "model.layers.0.mlp.down_proj"],
                 ignored_layers=["re:.*layers\\.1\\.self_attn\\.o_proj$"])
    q = _config(tmp_path, quant)[1].quantization
    assert not q.quantizes("model.layers.0.mlp.down_proj") and not q.quantizes("model.layers.1.self_attn.o_proj")
    assert q.quantizes("model.layers.1.mlp.down_proj") and q.quantizes("model.layers.0.self_attn.o_proj")
    with pytest.raises(ConfigError, match="field 'quantization_config.ignored_layers' must be a list of module names"):
        _config(tmp_path, dict(BLOCK, ignored_layers="lm_head"))
