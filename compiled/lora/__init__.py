"""Multi-LoRA serving: PEFT adapter loading (adapter.py; merge.py folds one into HF weights for oracles),
the slot pool with its CPU tier (pool.py), and the one running adapter folded into the weights (merged.py)."""

from compiled.lora.adapter import load_adapter
from compiled.lora.weights import Adapter, ExpertLoRAWeight, LoRAError, LoRAWeight

__all__ = ["load_adapter", "Adapter", "LoRAWeight", "ExpertLoRAWeight", "LoRAError"]
