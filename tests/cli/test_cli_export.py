"""`compiled export` of the demo model on the CPU, then `compiled run --artifact`: the run loads
the artifact (no Inductor compilation: compiling is on wherever an artifact is given) and prints
the tokens the eager engine prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from tests.conftest import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_export_then_run_from_the_artifact(tmp_path):
    artifact = tmp_path / "artifact"
    _cli("export", "--out", str(artifact), "--device", "cpu")
    with open(artifact / "manifest.json") as f:
        manifest = json.load(f)
    assert manifest["device"] == "cpu" and manifest["triton_kernels"] == 0 and manifest["pieces"]
    common = ("--device", "cpu", "--prompt", "The quick brown fox", "--max-new-tokens", "12")
    warm = _cli("run", *common, "--artifact", str(artifact))
    eager = _cli("run", *common, "--enforce-eager")
    assert warm.stdout == eager.stdout and warm.stdout.strip()
    assert "compiled pieces, 0 compiled now" in warm.stderr


def test_export_quantized_at_load_then_run_and_a_run_without_it_is_told(tmp_path):
    """`--quantization fp8` on export and run: the artifact's pieces are the FP8 graph's (the
    run compiles none, and prints the eager FP8 run's tokens); a run without the flag is refused
    naming the quantization, before it compiles anything."""
    artifact = tmp_path / "fp8"
    _cli("export", "--out", str(artifact), "--device", "cpu", "--quantization", "fp8")
    with open(artifact / "manifest.json") as f:
        assert json.load(f)["quantization"] == "fp8 block 128 x 128"
    common = ("--device", "cpu", "--prompt", "The quick brown fox", "--max-new-tokens", "12", "--quantization", "fp8")
    warm = _cli("run", *common, "--artifact", str(artifact))
    eager = _cli("run", *common, "--enforce-eager")
    assert warm.stdout == eager.stdout and warm.stdout.strip()
    assert "compiled pieces, 0 compiled now" in warm.stderr
    proc = subprocess.run([sys.executable, "-m", "cli.main", "run", *common[:6], "--artifact", str(artifact)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=child_env())
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (f"error: {artifact}: artifact does not fit: quantization is "
                                                    "'fp8 block 128 x 128' in the artifact but 'none' here")
