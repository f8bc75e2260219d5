"""Every environment variable the package reads, parsed and validated here and nowhere else.

Each variable is an override: the engine config (`runtime/config.py`) holds the choices a user
makes in code or on the command line; a variable set in the environment wins over them. A value
that does not parse is a one-line `EnvError` naming the variable and the values it takes."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from compiled.errors import CompiledError

BACKENDS = ("auto", "torch", "triton")


class EnvError(CompiledError):
    """An environment variable holds a value it cannot take."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    expected: str     # what the variable takes, for the error and the README
    doc: str


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError
    return text == "1"


def _backend(text: str) -> str:
    text = text.strip().lower()
    if text not in BACKENDS:
        raise ValueError
    return text


def _text(text: str) -> str:
    return text


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError
    return value


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("COMPILED_PDL", _flag, "0 or 1",
           "1 (default): Triton kernels use programmatic dependent launch on Hopper and newer GPUs"),
    EnvVar("COMPILED_ATTENTION_BACKEND", _backend, "|".join(BACKENDS),
           "overrides `attention_backend`: the Triton attention kernels or the torch reference"),
    EnvVar("COMPILED_LINEAR_BACKEND", _backend, "|".join(BACKENDS),
           "overrides `linear_backend`: the skinny GEMM / GEMV kernels or the torch reference"),
    EnvVar("COMPILED_MOE_BACKEND", _backend, "|".join(BACKENDS),
           "overrides `moe_backend`: the fused-MoE Triton kernels or the torch reference"),
    EnvVar("COMPILED_ROUTING_BACKEND", _backend, "|".join(BACKENDS),
           "overrides `routing_backend`: the top-k routing Triton kernel or the torch reference"),
    EnvVar("COMPILED_LORA_BACKEND", _backend, "|".join(BACKENDS),
           "overrides `lora_backend`: the multi-LoRA shrink / expand Triton kernels or the torch reference"),
    EnvVar("COMPILED_API_KEY", _text, "a key",
           "the key `compiled serve` asks of every /v1 request (`Authorization: Bearer KEY`) unless --api-key "
           "gives one"),
    EnvVar("COMPILED_MOE_CONFIG_DIR", _text, "a folder",
           "a folder of tuned fused-MoE configs, searched before the package's own"),
    EnvVar("WORLD_SIZE", _count, "an int >= 0",
           "set by torchrun (with RANK): the processes of the context-parallel group, which `LLM` joins"),
    EnvVar("RANK", _count, "an int >= 0", "set by torchrun: this process's rank in the context-parallel group"),
    EnvVar("MASTER_ADDR", _text, "a host", "the context-parallel group's rendezvous host (set for spawned workers)"),
    EnvVar("MASTER_PORT", _count, "a port", "the context-parallel group's rendezvous port (set for spawned workers)"),
    EnvVar("NCCL_NVLS_ENABLE", _flag, "0 or 1", "set to 0 for a context-parallel group on GPUs unless set: no "
           "NVLink multicast"),
    EnvVar("TORCH_SYMM_MEM_DISABLE_MULTICAST", _flag, "0 or 1", "set to 1 for a context-parallel group on GPUs "
           "unless set"),
    EnvVar("NVSHMEM_DISABLE_NVLS", _flag, "0 or 1", "set to 1 for a context-parallel group on GPUs unless set"),
    EnvVar("CUBLASLT_WORKSPACE_SIZE", _count, "an int >= 0 (KiB)",
           "torch's cuBLASLt workspace; an engine with FP8 weights sets it to 0 when unset, so that its "
           "prefill-sized linears take cuBLASLt's statically scheduled FP8 GEMMs (`linear/fp8_cublas.py` says why)"),
    EnvVar("TRITON_CACHE_DIR", _text, "a folder", "Triton's kernel cache (`compiled bench startup --fresh-caches` "
           "and `compiled export` point it at an empty folder; a start from an artifact copies the artifact's "
           "kernels into it, setting it to Triton's own folder when unset)"),
    EnvVar("TORCHINDUCTOR_CACHE_DIR", _text, "a folder", "Inductor's cache (`compiled bench startup "
           "--fresh-caches` points it at an empty folder)"),
    EnvVar("XDG_CACHE_HOME", _text, "a folder",
           "where `compiled bench` caches the measured copy bandwidth (default ~/.cache)"),
    EnvVar("OMP_WAIT_POLICY", _text, "PASSIVE|ACTIVE",
           "read by the demo-model trainer, which runs itself again with PASSIVE when it is unset"),
)}


def read(name: str) -> Any:
    """The parsed value of `name`, or None when it is unset or empty."""
    var = VARIABLES[name]
    text = os.environ.get(name, "")
    if text == "":
        return None
    try:
        return var.parse(text)
    except ValueError:
        raise EnvError(f"environment variable {name}={text!r}: expected {var.expected}") from None


def is_set(name: str) -> bool:
    return read(name) is not None


def set_for_children(name: str, value: str) -> None:
    """Put `name` into the environment that child processes inherit (validated like a read)."""
    os.environ[name] = value
    read(name)


def restore(name: str, previous: str | None) -> None:
    """Put `name` back as it was before a `set_for_children` (None: unset)."""
    if previous is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = previous


def check_all() -> None:
    """Read every variable, so that a bad value fails at start-up rather than at first use."""
    for name in VARIABLES:
        read(name)
