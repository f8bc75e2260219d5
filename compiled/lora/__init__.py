"""Multi-LoRA serving: PEFT adapter loading and normalisation (adapter.py; merge.py folds one into
base weights for oracles), and the adapter slot pool with its CPU tier (pool.py)."""

from compiled.lora.adapter import load_adapter
from compiled.lora.weights import Adapter, ExpertLoRAWeight, LoRAError, LoRAWeight

__all__ = ["load_adapter", "Adapter", "LoRAWeight", "ExpertLoRAWeight", "LoRAError"]
