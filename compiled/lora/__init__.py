"""Multi-LoRA serving: PEFT adapter loading and normalisation (adapter.py; merge.py folds one into
HF weights for oracles), the adapter slot pool with its CPU tier (pool.py), and the engine's
folding of its one running adapter into its weights (merged.py, `merge_lora`)."""

from compiled.lora.adapter import load_adapter
from compiled.lora.weights import Adapter, ExpertLoRAWeight, LoRAError, LoRAWeight

__all__ = ["load_adapter", "Adapter", "LoRAWeight", "ExpertLoRAWeight", "LoRAError"]
