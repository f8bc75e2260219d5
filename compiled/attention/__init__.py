"""KV cache pools and the attention custom op over them.

Torch reference kernels live here; Triton kernels join them later."""
