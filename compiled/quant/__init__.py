"""FP8 weight formats (Qwen block FP8, compressed-tensors): their config, scale shapes and recipes,
loading and quantize-at-load, and the dequantization references the ops and tests share."""
