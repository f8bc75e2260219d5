"""Random adapters in a model's real shapes, made in memory (benchmarks and GPU tests: no files)."""

from __future__ import annotations

import torch

from compiled.graphs.config import ModelConfig
from compiled.lora.weights import Adapter, ExpertLoRAWeight, LoRAWeight

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = {"all": ATTENTION + MLP, "attn": ATTENTION, "mlp": MLP}


def random_adapter(name: str, cfg: ModelConfig, rank: int, targets: str = "all", seed: int = 0,
                   std: float = 0.02, scaling: float = 2.0, device: str | torch.device = "cpu") -> Adapter:
    """An adapter of `rank` on `targets` ("all", "attn" or "mlp"; MLP includes MoE experts) with
    non-zero normal A and B of `std`, drawn on `device` (a GPU draws a 30B-sized one in
    milliseconds) and kept on the CPU, as loaded adapters are."""
    gen = torch.Generator(device=device).manual_seed(seed)
    adapter = Adapter(name, f"<random {name}>", rank)
    for layer in range(cfg.num_hidden_layers):
        for proj in TARGETS[targets]:
            expert = proj in MLP and cfg.is_moe_layer(layer)
            n_in, n_out = cfg.projection_shape(proj, expert)
            lead = (cfg.num_experts,) if expert else ()
            a = (torch.randn(*lead, rank, n_in, generator=gen, device=device) * std).cpu()
            b = (torch.randn(*lead, n_out, rank, generator=gen, device=device) * std).cpu()
            if expert:
                adapter.experts[(layer, proj)] = ExpertLoRAWeight(a, b, scaling)
            else:
                adapter.dense[(layer, proj)] = LoRAWeight(a, b, scaling)
    return adapter
