"""FP8 weight formats (Qwen block FP8, compressed-tensors): their config, scale shapes, recipes and
per-rank scale grids, loading and quantize-at-load, and the dequantization references ops and tests share."""
