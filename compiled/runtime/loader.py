"""Checkpoint -> model on the target device: build on meta, materialise once, stream tensors in.

Each safetensors tensor is read on its own and copied into its parameter, so peak memory is the
final model plus one tensor. Every inconsistency is a CheckpointError naming the file or tensor."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Iterator

import torch
from safetensors import safe_open

from compiled.errors import CheckpointError
from compiled.graphs.config import ModelConfig
from compiled.graphs.qwen3 import Qwen3ForCausalLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """Allocate the model once, in its final dtype and place, with uninitialised weights."""
    with torch.device("meta"), _default_dtype(dtype):
        model = Qwen3ForCausalLM(cfg)
    model.to_empty(device=device)
    model.reset_buffers()
    return model.eval().requires_grad_(False)


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e!r})") from None
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        for file in files:
            if not os.path.exists(file):
                raise CheckpointError(f"{file}: shard listed in {INDEX_FILE} is missing")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights found")
    return [os.path.join(path, f) for f in files]


def _iter_tensors(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise CheckpointError(f"{file}: cannot read safetensors ({str(e).splitlines()[0]})") from None


def load_weights(model: Qwen3ForCausalLM, path: str) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = model.config.tie_word_embeddings
    expected = {name for name in params if not (tied and name == "lm_head.weight")}
    loaded: set[str] = set()
    for file in checkpoint_files(path):
        for name, tensor in _iter_tensors(file):
            if tied and name == "lm_head.weight":
                continue  # some tied checkpoints store the head too; the embedding wins, as in HF
            param = params.get(name)
            if param is None:
                raise CheckpointError(f"{file}: unexpected tensor {name!r} for {model.config.architecture}")
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{file}: tensor {name!r} has shape {list(tensor.shape)}, expected {list(param.shape)}")
            if not tensor.is_floating_point():
                raise CheckpointError(f"{file}: tensor {name!r} has non-float dtype {tensor.dtype}")
            param.data.copy_(tensor)
            loaded.add(name)
    missing = sorted(expected - loaded)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: checkpoint is missing tensor {missing[0]!r}{more}")


def fill_dummy(model: Qwen3ForCausalLM, seed: int = 0) -> None:
    """Random weights in the real shapes, generated on the target device (no files read)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


def load_model(path: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               load_format: str = "auto", seed: int = 0) -> Qwen3ForCausalLM:
    model = build_model(cfg, device, dtype)
    if load_format == "dummy":
        fill_dummy(model, seed)
    elif load_format in ("auto", "safetensors"):
        load_weights(model, path)
    else:
        raise CheckpointError(f"unknown load_format {load_format!r} (expected 'auto' or 'dummy')")
    return model
