"""FP8 weight formats (Qwen block FP8, compressed-tensors float-quantized): their config, which
linears they quantize, the shapes of their scales, and the dequantization references."""
