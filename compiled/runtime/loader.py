"""Checkpoint -> parameters on the target device, following the graph's weight map.

The module is allocated once in its final (fused) form; each safetensors tensor is a view of the
memory-mapped shard, copied straight into its slice of the final parameter, so peak memory is the
final model. Every inconsistency is a CheckpointError naming the file or tensor."""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

import torch
from torch import nn

from compiled.errors import CheckpointError
from compiled.graphs.weights import WeightMap
from compiled.quant.at_load import rank_parts
from compiled.quant.config import QuantConfig
from compiled.quant.dequant import FP8
from compiled.quant.loading import dequantized_stream
from compiled.runtime.safetensors_io import iter_safetensors

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LOAD_FORMATS = ("auto", "safetensors", "dummy")


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


def iter_checkpoint(path: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file, tensor name, CPU view of the mapped file) for every tensor of every shard."""
    for file in checkpoint_files(path):
        for name, tensor in iter_safetensors(file):
            yield file, name, tensor


def assign_tensors(module: nn.Module, weights: WeightMap, tensors: Iterable[tuple[str, str, torch.Tensor]],
                   tied_head: bool = False) -> None:
    """Copy each (origin, name, tensor) into its slice of the final parameter; then check that
    every checkpoint tensor the weight map needs has arrived."""
    params = dict(module.named_parameters())
    by_source = weights.by_source()
    loaded: set[str] = set()
    for origin, name, tensor in tensors:
        if tied_head and name == "lm_head.weight":
            continue  # some tied checkpoints store the head too; the embedding wins, as in HF
        if name in weights.skipped:
            continue  # another rank's (expert parallelism): never read
        if name not in by_source:
            raise CheckpointError(f"{origin}: unexpected tensor {name!r}")
        target, piece = by_source[name]
        if tuple(tensor.shape) != piece.shape:
            raise CheckpointError(f"{origin}: tensor {name!r} has shape {list(tensor.shape)}, expected {list(piece.shape)}")
        if not tensor.is_floating_point():
            raise CheckpointError(f"{origin}: tensor {name!r} has non-float dtype {tensor.dtype}")
        if piece.narrow is not None:   # this rank's slice only (tensor parallelism)
            tensor = tensor.narrow(*piece.narrow)
        if piece.grid is not None:     # the scale blocks of this rank's slice, on its grid
            tensor = piece.grid.take(tensor)
        dst = params[target]
        if piece.expert is not None:
            dst = dst[piece.expert]
        if dst.shape != tensor.shape:
            dst = dst.narrow(0, piece.row, tensor.shape[0])
        dst.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(by_source) - loaded)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]!r}{more}")


def load_checkpoint(module: nn.Module, weights: WeightMap, path: str, tied_head: bool,
                    quant: QuantConfig | None = None, quantize_weights: bool = False) -> None:
    """Stream `path`'s tensors into `module`; FP8 weights (`quant`) stay FP8 where their parameter
    is float8_e4m3fn, else arrive dequantized (`quantize_weights`: quantized here first)."""
    params = dict(module.named_parameters())
    keep = {p.source for target, pieces in weights.pieces.items() if params[target].dtype == FP8 for p in pieces}
    weights, parts = rank_parts(weights, keep, quant) if quantize_weights else (weights, {})
    try:
        assign_tensors(module, weights, dequantized_stream(iter_checkpoint(path), quant, keep, quantize_weights,
                                                            next(module.parameters()).device, parts),
                       tied_head)
    except CheckpointError as e:
        if str(e).startswith("checkpoint is missing"):
            raise CheckpointError(f"{path}: {e}") from None
        raise


def fill_dummy(module: nn.Module, seed: int = 0) -> None:
    """Random weights in the real shapes, generated on the target device (no files read)."""
    device = next(module.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    fp8_names = {name for name, param in module.named_parameters() if param.dtype == FP8}
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif param.dtype == FP8:   # N(0, 1) in fp8 times a scale of 0.02 (its `_scale` parameter)
            param.data.copy_(torch.empty(param.shape, device=device).normal_(0.0, 1.0, generator=gen))
        elif name.endswith("_scale") and name[:-len("_scale")] in fp8_names:
            param.data.fill_(0.02)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
