"""Multi-LoRA serving: PEFT adapter loading and the GPU slot pool (in progress: nothing here yet).
The LoRA op and its kernels will sit with the other ops."""
