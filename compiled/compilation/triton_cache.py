"""Triton kernel binaries in an artifact: copied out of the cache folders a build compiled them
into, and into this process's cache folder before anything compiles, so that a start from the
artifact on a fresh machine compiles no kernel (the project's own and Inductor's alike).

Triton keeps one folder per compiled kernel, named by a hash of everything the binary depends on
(source, specialisation, options, target GPU, Triton version): a copied folder is only ever found
by the exact launch it was built for."""

from __future__ import annotations

import os
import shutil
import uuid

import torch

from compiled import envs

KERNELS = "triton"   # the artifact's folder of kernel folders


def _triton_default_folder() -> str:
    try:
        from triton import knobs
        return str(knobs.cache.dir)
    except (ImportError, AttributeError):
        return os.path.join(os.path.expanduser("~"), ".triton", "cache")


def cache_folders(device: torch.device) -> list[str]:
    """Where this process's Triton kernels are cached: Triton's folder and Inductor's (one folder
    when TRITON_CACHE_DIR is set)."""
    chosen = envs.read("TRITON_CACHE_DIR")
    if chosen is not None:
        return [chosen]
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    folders = [_triton_default_folder(), triton_cache_dir(device.index or 0)]
    return list(dict.fromkeys(folders))


def kernel_entries(folder: str) -> set[str]:
    """The kernel folders in a Triton cache folder."""
    if not os.path.isdir(folder):
        return set()
    return {name for name in os.listdir(folder) if os.path.isdir(os.path.join(folder, name))}


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _copy_entries(source: str, target: str, names: set[str]) -> int:
    """Copy the kernel folders `names` of `source` missing from `target`; each lands whole (built
    under a temporary name, then renamed) so a process compiling beside this one never reads half."""
    os.makedirs(target, exist_ok=True)
    copied = 0
    for name in sorted(names - kernel_entries(target)):
        staging = os.path.join(target, f".{name}.{uuid.uuid4().hex}")
        shutil.copytree(os.path.join(source, name), staging, copy_function=_link_or_copy)
        try:
            os.rename(staging, os.path.join(target, name))
            copied += 1
        except OSError:   # another process put it there first
            shutil.rmtree(staging, ignore_errors=True)
    return copied


def save_kernels(artifact: str, device: torch.device) -> int:
    """Copy every kernel in this process's Triton cache folders into `artifact`; the count."""
    if device.type != "cuda":
        return 0
    target = os.path.join(artifact, KERNELS)
    for folder in cache_folders(device):
        _copy_entries(folder, target, kernel_entries(folder))
    return len(kernel_entries(target))


def install_kernels(artifact: str) -> int:
    """Make the artifact's kernels visible to Triton here: copied into this process's cache folder
    (TRITON_CACHE_DIR, set to Triton's own folder when unset so that Inductor's kernels are looked
    up there too). Returns how many were copied."""
    source = os.path.join(artifact, KERNELS)
    names = kernel_entries(source)
    if not names:
        return 0
    target = envs.read("TRITON_CACHE_DIR")
    if target is None:
        target = _triton_default_folder()
        envs.set_for_children("TRITON_CACHE_DIR", target)
    return _copy_entries(source, target, names)
