"""Loading a PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`) for a
base model, checked against it and normalised into one representation (`Adapter`, see weights.py)
whatever layout the file uses (layouts.py) and however its config targets modules (peft_config.py).

Scaling is PEFT's: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`, with r and alpha
per module from `rank_pattern` / `alpha_pattern`. Every problem is a one-line `LoRAError` naming
the adapter, its folder and the file, field or tensor at fault."""

from __future__ import annotations

import os

import torch

from compiled.graphs.config import ModelConfig
from compiled.json_file import read_json_object
import compiled.lora.layouts as layouts
from compiled.lora.peft_config import PeftLoraConfig, read_config
from compiled.lora.weights import Adapter, ExpertLoRAWeight, LoRAError, LoRAWeight

__all__ = ["load_adapter", "read_tensors", "Adapter", "LoRAWeight", "ExpertLoRAWeight", "LoRAError"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def load_adapter(name: str, path: str, model_config: ModelConfig, max_lora_rank: int) -> Adapter:
    """Read the PEFT adapter in folder `path` for the base model `model_config` and normalise it:
    float32 `LoRAWeight` per dense projection and `ExpertLoRAWeight` per expert projection (MoE
    gate and up separate, also when the file fuses them). Every rank must be at most
    `max_lora_rank`. Raises `LoRAError` (one line naming `name`, `path` and the culprit)."""

    def fail(msg: str) -> LoRAError:
        return LoRAError(" ".join(f"adapter {name!r} ({path}): {msg}".split()))

    if isinstance(max_lora_rank, bool) or not isinstance(max_lora_rank, int) or max_lora_rank <= 0:
        raise fail(f"max_lora_rank must be a positive integer, got {max_lora_rank!r}")
    if not os.path.isdir(path):
        raise fail("not found" if not os.path.exists(path) else "not a folder")
    cfg = read_config(os.path.join(path, CONFIG_FILE), model_config, fail)
    _check_added_tokens(path, model_config, fail)
    tensors = read_tensors(os.path.join(path, WEIGHTS_FILE), fail)
    if not tensors:
        raise fail(f"{WEIGHTS_FILE} holds no tensors")
    return normalise(name, path, cfg, tensors, model_config, max_lora_rank, fail)


def normalise(name: str, path: str, cfg: PeftLoraConfig, tensors: dict[str, torch.Tensor],
              model_config: ModelConfig, max_lora_rank: int, fail) -> Adapter:
    groups = layouts.group(tensors, model_config, fail)
    dense = layouts.dense(groups, tensors, cfg, model_config, fail)
    experts = layouts.experts(groups, tensors, cfg, model_config, fail)
    for (weight, key, target) in list(dense.values()) + list(experts.values()):
        if weight.rank > max_lora_rank:
            raise fail(f"tensor {key!r} has rank {weight.rank} (r={target.r} from {target.r_source}), "
                       f"above max_lora_rank {max_lora_rank}")
    adapter = Adapter(name=name, path=path, rank=0,
                      dense={k: v[0] for k, v in dense.items()},
                      experts={k: v[0] for k, v in experts.items()})
    adapter.rank = max(w.rank for w in list(adapter.dense.values()) + list(adapter.experts.values()))
    return adapter


def read_tensors(file: str, fail) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, as float32 CPU tensors."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(file):
        folder = os.path.dirname(file)
        other = [f for f in ("adapter_model.bin", "adapter_model.pt") if os.path.exists(os.path.join(folder, f))]
        raise fail(f"{file} not found" + (f" ({other[0]} is not read: only safetensors)" if other else ""))
    out = {}
    try:
        with safe_open(file, "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if not t.is_floating_point():
                    raise fail(f"{file}: tensor {key!r} has dtype {t.dtype}, expected floating point")
                out[key] = t.to(torch.float32)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        if isinstance(e, LoRAError):
            raise
        raise fail(f"{file}: cannot read safetensors ({e})") from None
    return out


def _check_added_tokens(path: str, model_config: ModelConfig, fail) -> None:
    """PEFT adapters trained after adding tokens ship `added_tokens.json`; ids inside the base
    vocabulary are harmless, any beyond it needs embeddings this adapter cannot bring."""
    file = os.path.join(path, "added_tokens.json")
    if not os.path.exists(file):
        return
    added = read_json_object(file, fail)
    if not all(isinstance(v, int) for v in added.values()):
        raise fail(f"{file}: expected an object of token -> id")
    new = sorted((i, t) for t, i in added.items() if i >= model_config.vocab_size)
    if new:
        raise fail(f"{file}: adds {len(new)} tokens beyond the base vocabulary of {model_config.vocab_size} "
                   f"(first {new[0][1]!r} = {new[0][0]}); adapters that add tokens are not supported")
