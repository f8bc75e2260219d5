"""Multi-LoRA: PEFT adapter loading, GPU slot pool and batched delta kernels.

Empty until the LoRA issue lands."""
