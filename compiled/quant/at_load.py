"""Quantize at load: `quantization="fp8"` turns an unquantized checkpoint into block FP8 (128 x 128
blocks, as Qwen publishes) while it streams in, one tensor at a time, so no full-precision copy of
the model is ever held; with dummy weights it gives FP8 weights in the real shapes."""

from __future__ import annotations

from dataclasses import replace

from compiled.errors import ConfigError
from compiled.graphs.config import ModelConfig
from compiled.quant.config import QuantConfig

METHODS = {"fp8": QuantConfig("fp8", "block", (128, 128))}


def with_quantization(cfg: ModelConfig, quantization: str | None) -> tuple[ModelConfig, bool]:
    """(the config the model is built from, whether its weights are quantized while loading). A
    checkpoint that is FP8 already loads as it is."""
    if quantization is None or cfg.quantization is not None:
        return cfg, False
    if quantization not in METHODS:
        raise ConfigError(f"quantization={quantization!r}: expected None or one of {', '.join(METHODS)}")
    return replace(cfg, quantization=METHODS[quantization]), True
