"""Peak memory of loading a sharded per-expert MoE checkpoint through the fusing loader.

CPU: the peak of anonymous resident memory (RssAnon, sampled whenever a checkpoint tensor is
alive) above the level before loading, against the final parameter bytes. CUDA:
torch.cuda.max_memory_allocated against the parameter bytes. Prints one JSON line.

  python bench/load_memory.py write DIR [--layers N] [--config CONFIG_DIR]   # make a checkpoint
  python bench/load_memory.py load DIR [--device cuda]                        # measure
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

from compiled.graphs.config import ModelConfig
from compiled.graphs.trace import meta_model

SMALL_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=1000, hidden_size=512, intermediate_size=1024,
                 num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                 num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
                 max_position_embeddings=512, torch_dtype="float32")


def write_checkpoint(out: str, raw: dict, shard_bytes: int = 64 << 20, dtype=torch.float32) -> int:
    """Random tensors in the published per-expert layout, sharded with an index; returns bytes."""
    os.makedirs(out, exist_ok=True)
    cfg = ModelConfig.from_dict(raw)
    model = meta_model(cfg, dtype)
    shapes = [(p.source, p.shape) for pieces in model.checkpoint_map().pieces.values() for p in pieces]
    shards, current, size, total = [], {}, 0, 0
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes:
        current[name] = torch.randn(shape, generator=gen).mul_(0.02).to(dtype)
        size += current[name].numel() * current[name].element_size()
        if size >= shard_bytes:
            shards.append(current)
            total, current, size = total + size, {}, 0
    if current:
        shards.append(current)
        total += size
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f)
    return total


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def measure(path: str, device: str, dtype: torch.dtype) -> dict:
    """Trace and pass the graph first (Python objects, not weights), then measure what
    materialising and loading the weights adds."""
    import compiled.runtime.loader as loader
    from compiled.graphs.trace import materialize, trace
    from compiled.passes.manager import run_passes
    cfg = ModelConfig.from_pretrained(path)
    meta = meta_model(cfg, dtype)
    result = run_passes(trace(meta), meta.checkpoint_map(), check="end")
    peak = {"rss": 0}
    original = loader.iter_checkpoint

    def sampled(p):
        for item in original(p):
            peak["rss"] = max(peak["rss"], _rss_anon())   # the tensor just read is alive here
            yield item
    loader.iter_checkpoint = sampled
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = _rss_anon()
    model = materialize(result.gm, dev)
    loader.load_checkpoint(model, result.weights, path, tied_head=cfg.tie_word_embeddings)
    peak["rss"] = max(peak["rss"], _rss_anon())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {"device": device, "param_bytes": param_bytes}
    if dev.type == "cuda":
        out["max_allocated"] = torch.cuda.max_memory_allocated()
        out["ratio"] = out["max_allocated"] / param_bytes
    else:
        out["peak_rss_anon_above_base"] = peak["rss"] - base
        out["ratio"] = out["peak_rss_anon_above_base"] / param_bytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=["write", "load"])
    ap.add_argument("dir")
    ap.add_argument("--config", help="config folder to take the shape from (default: a small MoE)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.action == "write":
        raw = dict(SMALL_MOE)
        if args.config:
            with open(os.path.join(args.config, "config.json")) as f:
                raw = json.load(f)
        if args.layers:
            raw["num_hidden_layers"] = args.layers
        print(json.dumps({"bytes": write_checkpoint(args.dir, raw, dtype=dtype)}))
    else:
        print(json.dumps(measure(args.dir, args.device, dtype)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
