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
