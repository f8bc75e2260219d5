"""Loading through the fusing loader peaks at the final parameter bytes (DESIGN.md section 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests.conftest import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*args: str) -> dict:
    env = child_env()
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "load_memory.py"), *args],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_load_peak_is_final_size(tmp_path):
    """A sharded, per-expert-layout MoE checkpoint of >= 200 MB loads in <= 1.15x its params."""
    written = _bench("write", str(tmp_path), "--layers", "4")
    assert written["bytes"] >= 200e6
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) >= 3
    result = _bench("load", str(tmp_path))
    assert result["param_bytes"] == written["bytes"]
    assert result["ratio"] <= 1.15, result


@pytest.mark.gpu
def test_gpu_load_of_reduced_qwen3_30b_a3b(tmp_path):
    config = os.path.join(ROOT, "bench", "configs", "qwen3-30b-a3b")
    _bench("write", str(tmp_path), "--config", config, "--layers", "2", "--dtype", "bfloat16")
    result = _bench("load", str(tmp_path), "--device", "cuda", "--dtype", "bfloat16")
    print(result)
    assert result["ratio"] <= 1.05, result
