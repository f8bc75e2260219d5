"""Compiled artifacts: the unique pieces' Inductor outputs, the Triton kernels' binaries and a
manifest of what they fit.

A later start loads them instead of running Inductor. The manifest names everything the
compiled code depends on; loading checks each field and names the first that differs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Callable

import torch

from compiled.errors import CompiledError
from compiled.graphs.config import ModelConfig
from compiled.passes.manager import pass_hashes

MANIFEST = "manifest.json"
FORMAT = 5  # 3: passes recorded with the hash of their source, splitting ops listed; 4: piece keys
#              hash the schemas of the project ops a piece calls; 5: the weights' quantization recorded
# Fields that must match for the compiled code to be valid here, in the order they are checked.
# tensor_parallel_size: set only above 1 (absent, as in artifacts written before it, means 1); every
# rank's graph is the same code over its own slices, so one artifact serves all of them.
# enable_expert_parallel: set only when true, with tensor_parallel_size above 1.
# quantization: checked before model_config (which hashes it too), so that a run without the
# export's --quantization is told so.
CHECKED = ("format", "package", "torch", "triton", "device", "quantization", "model_config", "passes", "splitting_ops",
           "dtype", "tensor_parallel_size", "enable_expert_parallel")


class ArtifactError(CompiledError, ValueError):
    """An artifact folder is missing, incomplete, or was built for something else."""


def config_hash(cfg: ModelConfig) -> str:
    # An unquantized model hashes as it did before the quantization field existed.
    fields = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k != "source" and not (k == "quantization" and v is None)}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _triton_version() -> str | None:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


def manifest_for(cfg: ModelConfig, passes: list[str] | tuple[str, ...], splitting_ops: tuple[str, ...],
                 dtype: torch.dtype, device: torch.device) -> dict:
    """What compiled code depends on; `passes` are recorded with the hash of each one's source."""
    from compiled.version import __version__
    return {
        "format": FORMAT, "package": __version__, "torch": torch.__version__, "triton": _triton_version(),
        "device": device_name(device), "model_config": config_hash(cfg), "passes": pass_hashes(passes),
        "splitting_ops": list(splitting_ops), "dtype": str(dtype).replace("torch.", ""),
        "architecture": cfg.architecture, "quantization": quantization_name(cfg),
    }


def quantization_name(cfg: ModelConfig) -> str:
    """How the model's weights are stored, in a manifest's words: "none", or e.g. "fp8 block 128 x 128"."""
    q = cfg.quantization
    if q is None:
        return "none"
    return f"{q.method} {q.scheme}" + (f" {q.block[0]} x {q.block[1]}" if q.block else "")


def save_artifact(folder: str, manifest: dict, compiled: dict, buckets: dict[str, list[int]] | None,
                  device: torch.device) -> None:
    """The pieces, the Triton kernels this process has cached (`triton_cache.py`) and the manifest."""
    from compiled.compilation.triton_cache import save_kernels
    os.makedirs(folder, exist_ok=True)
    pieces = {}
    for key, artifact in compiled.items():
        name = f"piece-{key}.bin"
        artifact.save(path=os.path.join(folder, name), format="binary")
        pieces[key] = name
    kernels = save_kernels(folder, device)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(dict(manifest, pieces=pieces, buckets=buckets, triton_kernels=kernels), f, indent=1)


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise ArtifactError(f"{folder}: not a compiled artifact (no {MANIFEST})")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: malformed manifest ({e.msg})") from None


def mismatch(found: dict, expected: dict) -> str | None:
    """The first checked field that differs, as a readable phrase, or None."""
    for key in CHECKED:
        if found.get(key) != expected.get(key):
            return f"{key} is {found.get(key)!r} in the artifact but {expected.get(key)!r} here"
    return None


def load_artifact(folder: str, expected: dict) -> dict[str, Callable]:
    """key -> loaded compiled piece, with the artifact's Triton kernels put where Triton looks.
    Raises ArtifactError naming the mismatched field."""
    from compiled.compilation.triton_cache import install_kernels
    manifest = read_manifest(folder)
    problem = mismatch(manifest, expected)
    if problem:
        raise ArtifactError(f"{folder}: artifact does not fit: {problem}")
    install_kernels(folder)
    loaded = {}
    for key, name in manifest.get("pieces", {}).items():
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise ArtifactError(f"{path}: compiled piece listed in the manifest is missing")
        loaded[key] = torch._inductor.CompiledArtifact.load(path=path, format="binary")
    return loaded
