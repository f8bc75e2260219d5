"""Shared test helpers: small random-weight HF checkpoints written to a temp folder."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DENSE = dict(vocab_size=123, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False)
MOE = dict(DENSE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[])


def make_checkpoint(path, moe: bool = False, seed: int = 0, dtype=torch.float32, **overrides) -> str:
    """Save a randomly initialised HF Qwen3 / Qwen3-MoE model to `path` and return it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**dict(MOE, **overrides)))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**dict(DENSE, **overrides)))
    model.to(dtype).save_pretrained(str(path))
    return str(path)


def reduced_real_config(folder, name: str = "qwen3-30b-a3b", layers: int = 4) -> str:
    """A folder with only the config.json of bench/configs/`name`, cut to `layers` layers (every
    layer shape of the real model, for load_format="dummy")."""
    import json
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "bench", "configs", name, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(folder)


def hf_model(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped, visibly, on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
