"""The artifact's Triton kernels: saved from this process's cache folder, installed into the next
process's, never overwriting, leaving no half-copied folder; on a CPU nothing is saved."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from compiled.compilation import triton_cache


def _kernel(folder, name: str, payload: str) -> None:
    os.makedirs(os.path.join(folder, name))
    for ext in ("cubin", "json"):
        with open(os.path.join(folder, name, f"k.{ext}"), "w") as f:
            f.write(f"{payload}-{ext}")


def _read(folder, name: str) -> str:
    with open(os.path.join(folder, name, "k.cubin")) as f:
        return f.read()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir()
    _kernel(folder, "AAAA", "a")
    _kernel(folder, "BBBB", "b")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(folder))
    return folder


def test_save_copies_every_kernel_folder(cache, tmp_path):
    artifact = tmp_path / "artifact"
    assert triton_cache.save_kernels(str(artifact), torch.device("cuda")) == 2
    assert triton_cache.kernel_entries(str(artifact / triton_cache.KERNELS)) == {"AAAA", "BBBB"}
    assert _read(artifact / triton_cache.KERNELS, "BBBB") == "b-cubin"


def test_save_on_cpu_writes_nothing(cache, tmp_path):
    assert triton_cache.save_kernels(str(tmp_path / "artifact"), torch.device("cpu")) == 0
    assert not (tmp_path / "artifact").exists()


def test_install_fills_the_cache_once_and_keeps_what_is_there(cache, tmp_path, monkeypatch):
    artifact = tmp_path / "artifact"
    triton_cache.save_kernels(str(artifact), torch.device("cuda"))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _kernel(fresh, "AAAA", "already-here")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh))
    assert triton_cache.install_kernels(str(artifact)) == 1
    assert triton_cache.install_kernels(str(artifact)) == 0
    assert sorted(os.listdir(fresh)) == ["AAAA", "BBBB"]   # no staging folder left behind
    assert _read(fresh, "AAAA") == "already-here-cubin" and _read(fresh, "BBBB") == "b-cubin"


def test_install_without_a_cache_folder_set_uses_tritons_and_sets_it(cache, tmp_path, monkeypatch):
    artifact = tmp_path / "artifact"
    triton_cache.save_kernels(str(artifact), torch.device("cuda"))
    default = tmp_path / "home-triton"
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setattr(triton_cache, "_triton_default_folder", lambda: str(default))
    assert triton_cache.install_kernels(str(artifact)) == 2
    assert os.environ["TRITON_CACHE_DIR"] == str(default)   # Inductor's kernels are looked up there too
    assert triton_cache.kernel_entries(str(default)) == {"AAAA", "BBBB"}


def test_artifact_without_kernels_installs_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert triton_cache.install_kernels(str(tmp_path)) == 0
    assert "TRITON_CACHE_DIR" not in os.environ


def test_installed_kernel_is_a_cache_hit_once_the_exporting_cache_is_gone(tmp_path, monkeypatch):
    """Triton's group file names each file by absolute path: after install it must name the new
    folder, or Triton misses (and recompiles) on a machine that never had the exporter's cache."""
    cache_module = pytest.importorskip("triton.runtime.cache")
    exporter, fresh, artifact = tmp_path / "exporter", tmp_path / "fresh", tmp_path / "artifact"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(exporter))
    built = cache_module.FileCacheManager("KEY")
    group = {name: built.put(f"{name} bytes", name) for name in ("k.cubin", "k.json")}
    built.put_group("k.json", group)
    triton_cache.save_kernels(str(artifact), torch.device("cuda"))
    shutil.rmtree(exporter)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh))
    assert triton_cache.install_kernels(str(artifact)) == 1
    found = cache_module.FileCacheManager("KEY").get_group("k.json")
    assert found == {name: str(fresh / "KEY" / name) for name in ("k.cubin", "k.json")}
    with open(artifact / triton_cache.KERNELS / "KEY" / "__grp__k.json") as f:   # the artifact keeps its own
        assert str(exporter) in f.read()


def test_counting_compiles_counts_what_triton_reports_and_puts_the_listener_back():
    knobs = pytest.importorskip("triton").knobs
    before = knobs.compilation.listener
    with triton_cache.counting_compiles() as counts:
        for hit in (False, True, True):   # as Triton's compile() reports a miss and two hits
            knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=None, cache_hit=hit)
    assert counts == {"compiled": 1, "cached": 2}
    assert knobs.compilation.listener is before
