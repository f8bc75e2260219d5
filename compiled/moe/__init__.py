"""Mixture-of-experts custom ops: softmax-top-k routing (a rank's own experts) and the fused experts
(expert LoRA), options as optional operands; their Triton kernels for CUDA and torch references."""
