"""KV cache pools and the attention custom op over them.

Torch reference kernels (`reference`) serve CPU and act as the oracle; the Triton kernels
(`triton_store`, `triton_decode` flash-decoding, `triton_extend` varlen prefill) serve CUDA."""
