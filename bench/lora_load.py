"""How long the CPU tier takes to put one adapter into a GPU slot, without the model's weights:

    python bench/lora_load.py bench/configs/qwen3-30b-a3b --rank 16 --loads 6

Builds the LoRA slot buffers the `lora_delta` pass gives the model (rank R, every attention and
expert projection) on bare modules, and a pool over them with random adapters in the real shapes.
Times, per adapter: packing it for the tier (`prepare`: cast into one block and, on a GPU,
page-lock it), then loads into alternating slots from `acquire` to the copy landing, once from
the page-locked block and once from the same factors left pageable (the staging ring's path)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from compiled.graphs.config import ModelConfig
from compiled.lora.pool import LoRAPool
from compiled.lora.random import random_adapter


def slot_buffers(cfg: ModelConfig, slots: int, rank: int, dtype: torch.dtype, device: str) -> nn.Module:
    """A module tree holding the buffers `lora_delta` would register (fused qkv and o_proj per
    layer; experts per MoE layer), by the same module names."""
    def buffers(module: nn.Module, **shapes) -> nn.Module:
        for name, shape in shapes.items():
            kind = torch.float32 if name == "lora_scale" else dtype
            module.register_buffer(name, torch.zeros(shape, dtype=kind, device=device), persistent=False)
        return module

    H, R, E, I = cfg.hidden_size, rank, cfg.num_experts, cfg.moe_intermediate_size
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList()
    for layer in range(cfg.num_hidden_layers):
        block = nn.Module()
        block.self_attn = nn.Module()
        block.self_attn.qkv_proj = buffers(nn.Module(), lora_a=(slots, 3 * R, H),
                                           lora_b=(slots, cfg.q_size + 2 * cfg.kv_size, R), lora_scale=(slots, 3))
        block.self_attn.o_proj = buffers(nn.Module(), lora_a=(slots, R, cfg.q_size), lora_b=(slots, H, R),
                                         lora_scale=(slots, 1))
        if cfg.is_moe_layer(layer):
            block.mlp = buffers(nn.Module(), lora_a13=(slots, E, 2 * R, H), lora_b13=(slots, E, 2 * I, R),
                                lora_a2=(slots, E, R, I), lora_b2=(slots, E, H, R), lora_scale=(slots, 3))
        root.model.layers.append(block)
    return root


def timed_load(pool: LoRAPool, name: str) -> float:
    start = time.perf_counter()
    slot = pool.acquire(name, set())
    pool.wait(slot)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a folder with the model's config.json")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--loads", type=int, default=6, help="adapters loaded (each once per path)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = ModelConfig.from_pretrained(args.model)
    dtype = getattr(torch, args.dtype)
    pool = LoRAPool(slot_buffers(cfg, 2, args.rank, dtype, device), cfg, args.rank, None)
    prepare_s, locked_s, pageable_s = [], [], []
    for i in range(args.loads):
        adapter = random_adapter(f"a{i}", cfg, args.rank, "all", seed=i, device=device)
        start = time.perf_counter()
        packed = pool.prepare(adapter)
        prepare_s.append(time.perf_counter() - start)
        pool.add(packed)
        pool.in_slot, pool.slot_of = [None, None], {}    # every load a fresh copy
        locked_s.append(timed_load(pool, packed.name))
        packed.host.unlock()                             # the same block, pageable
        pool.in_slot, pool.slot_of = [None, None], {}
        pageable_s.append(timed_load(pool, packed.name))
        pool.remove(packed.name)
    size = packed.host.data.numel()
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "adapter_bytes": size,
           "prepare_ms": [1e3 * s for s in prepare_s], "locked_ms": [1e3 * s for s in locked_s],
           "pageable_ms": [1e3 * s for s in pageable_s]}
    for key in ("prepare_ms", "locked_ms", "pageable_ms"):
        ms = statistics.median(out[key][1:] or out[key])   # the first load also warms up the loader
        print(f"{key[:-3]:>9}: median {ms:8.1f} ms ({size / ms / 1e6:6.1f} GB/s), all {[round(v, 1) for v in out[key]]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
