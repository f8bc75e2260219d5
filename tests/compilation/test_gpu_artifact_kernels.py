"""A start from an exported artifact on a fresh machine: `compiled export` on the GPU, its cache
folders deleted, then new processes with empty Triton and Inductor cache folders start from the
artifact and generate. They compile no Inductor piece and no Triton kernel (Triton's own count of
its compilations), and their tokens equal an engine compiled from scratch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import child_env

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

START = """
import json, os, sys
from compiled import LLM, SamplingParams
from compiled.compilation import triton_cache
from compiled.compilation.inductor import COMPILES
artifact = sys.argv[1] or None
with triton_cache.counting_compiles() as triton_compiles:
    llm = LLM(None, device="cuda", artifact=artifact)
    prompts = [[5, 6, 7, 8, 9] * 20, [3] * 37, [11]]
    out = llm.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    llm.engine.capture_pending_graphs()   # the buckets left for later compile nothing either
print(json.dumps({"tokens": [o.token_ids for o in out], "inductor_compiles": COMPILES["count"],
                  "triton": triton_compiles,
                  "kernels": sorted(triton_cache.kernel_entries(os.environ["TRITON_CACHE_DIR"]))}))
"""


def _fresh_env(tmp_path, name: str) -> dict:
    env = child_env()
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        folder = tmp_path / f"{name}-{var.lower()}"
        folder.mkdir()
        env[var] = str(folder)
    return env


def _start(tmp_path, name: str, artifact: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", START, artifact], env=_fresh_env(tmp_path, name),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_start_from_artifact_compiles_nothing(tmp_path):
    from compiled.compilation.triton_cache import KERNELS, kernel_entries
    artifact = tmp_path / "artifact"
    export = subprocess.run([sys.executable, "-m", "cli.main", "export", "--out", str(artifact), "--device", "cuda"],
                            env=_fresh_env(tmp_path, "export"), capture_output=True, text=True, timeout=900,
                            cwd=ROOT)
    assert export.returncode == 0, export.stderr[-3000:]
    shipped = kernel_entries(str(artifact / KERNELS))
    with open(artifact / "manifest.json") as f:
        assert json.load(f)["triton_kernels"] == len(shipped) > 0
    for var in ("triton_cache_dir", "torchinductor_cache_dir"):   # another machine: the exporter's caches gone
        shutil.rmtree(tmp_path / f"export-{var}")
    reference = _start(tmp_path, "scratch", "")
    assert reference["inductor_compiles"] > 0 and reference["triton"]["compiled"] > 0   # from scratch both show
    warm = _start(tmp_path, "fresh", str(artifact))
    assert warm["inductor_compiles"] == 0
    assert warm["triton"]["compiled"] == 0 and warm["triton"]["cached"] > 0, warm["triton"]
    assert set(warm["kernels"]) - shipped == set(), "kernels compiled despite the artifact"
    assert warm["tokens"] == reference["tokens"]
