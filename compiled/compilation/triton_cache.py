"""Triton kernel binaries in an artifact: copied out of the cache folders a build compiled them
into, and into this process's cache folder before anything compiles, so that a start from the
artifact on a fresh machine compiles no kernel (the project's own and Inductor's alike).

Triton keeps one folder per compiled kernel, named by a hash of everything the binary depends on
(source, specialisation, options, target GPU, Triton version): a copied folder is only ever found
by the exact launch it was built for. A folder's group file lists its files by absolute path, and
Triton counts a kernel cached only when every listed file exists: on install the group files are
rewritten to the folder they land in (as they stand they name the exporting machine's cache)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from typing import Iterator

import torch

import compiled.envs as envs

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


GROUP_PREFIX = "__grp__"   # Triton's group files: {"child_paths": {file name: absolute path}}


def _point_groups_at(staging: str, final: str) -> None:
    """Rewrite the group files in `staging` so that they list the files under `final`, the
    folder `staging` is about to be renamed to. Written anew: the old file may be a hard link."""
    for name in os.listdir(staging):
        if not name.startswith(GROUP_PREFIX):
            continue
        path = os.path.join(staging, name)
        with open(path) as f:
            group = json.load(f)
        children = {child: os.path.join(final, os.path.basename(old))
                    for child, old in group.get("child_paths", {}).items()}
        os.unlink(path)
        with open(path, "w") as f:
            json.dump({"child_paths": children}, f)


def _copy_entries(source: str, target: str, names: set[str], repoint: bool = False) -> int:
    """Copy the kernel folders `names` of `source` missing from `target`; each lands whole (built
    under a temporary name, then renamed) so a process compiling beside this one never reads half.
    `repoint`: rewrite the group files to the copy (an install)."""
    os.makedirs(target, exist_ok=True)
    copied = 0
    for name in sorted(names - kernel_entries(target)):
        staging = os.path.join(target, f".{name}.{uuid.uuid4().hex}")
        shutil.copytree(os.path.join(source, name), staging, copy_function=_link_or_copy)
        if repoint:
            _point_groups_at(staging, os.path.join(target, name))
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
    return _copy_entries(source, target, names, repoint=True)


@contextlib.contextmanager
def counting_compiles(enabled: bool = True) -> Iterator[dict | None]:
    """Within: {"compiled": n, "cached": m}, the Triton kernels this process compiles and those it
    finds in its cache (Triton's compilation listener; a cached kernel names no new folder, so a
    count of folders cannot tell a recompile from a hit). None with a Triton that has no listener,
    or where not `enabled` (off a GPU, where the count means nothing)."""
    if not enabled:
        yield None
        return
    try:
        from triton import knobs
        knobs.compilation.listener
    except (ImportError, AttributeError):
        yield None
        return
    counts = {"compiled": 0, "cached": 0}
    previous = knobs.compilation.listener

    def listen(*, cache_hit: bool, **_) -> None:
        counts["cached" if cache_hit else "compiled"] += 1

    knobs.compilation.listener = listen
    try:
        yield counts
    finally:
        knobs.compilation.listener = previous
