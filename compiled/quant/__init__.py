"""FP8 weight formats (Qwen block FP8, compressed-tensors): config, scale shapes, recipes, per-rank scale grids,
loading, quantize-at-load, the dequantization references, and activations quantized per token group (W8A8)."""
