"""FP8 test checkpoints: a small random HF checkpoint quantized into float8_e4m3fn + scales, and
beside it the same model holding the dequantized weights (the oracle HF transformers loads)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from compiled.errors import ConfigError
from compiled.quant.config import parse_quantization
from compiled.quant.dequant import dequantize, quantize

BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def compressed_tensors(strategy: str = "channel", ignore=("lm_head",), static: bool = False, kv: bool = False) -> dict:
    """A compressed-tensors FP8 config; `static`: per-tensor activation scales stored (`input_scale`),
    `kv`: a KV cache scheme (each attention's `k_scale` and `v_scale`)."""
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "strategy": "tensor" if static else "token", "dynamic": not static}
    kv_scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "kv_cache_scheme": kv_scheme if kv else None}


def quantize_checkpoint(src: str, dst: str, reference: str, quant_config: dict,
                        scale_dtype: torch.dtype = torch.float32) -> tuple[str, str]:
    """Write `src` (a single-file checkpoint) quantized to `dst` and its dequantized twin to
    `reference`; return both paths. A static activation scheme stores a random positive
    `input_scale` beside each quantized weight, a KV cache scheme a `k_scale` and `v_scale` beside
    each attention's k_proj (calibration's output, which the engine checks and does not use)."""
    quant = parse_quantization(quant_config, ConfigError)
    quantized, dequantized = {}, {}
    for name, tensor in load_file(os.path.join(src, "model.safetensors")).items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and quant.quantizes(module):
            q, s = quantize(tensor, quant, scale_dtype)
            quantized[name], quantized[f"{module}.{quant.scale_suffix}"] = q, s
            if quant.activation_scheme == "static":
                quantized[f"{module}.input_scale"] = torch.rand(1) / 50 + 0.01
            dequantized[name] = dequantize(q, s, quant, torch.float32)
        else:
            quantized[name] = dequantized[name] = tensor
        if quant.kv_cache_scales and name.endswith(".self_attn.k_proj.weight"):
            attention = name.rsplit(".", 2)[0]
            quantized[f"{attention}.k_scale"], quantized[f"{attention}.v_scale"] = torch.rand(2) + 0.5
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for folder, tensors, extra in ((dst, quantized, {"quantization_config": quant_config}), (reference, dequantized, {})):
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(dict(config, **extra), f)
    return str(dst), str(reference)
