"""Greedy argmax (compiled/runtime/argmax.py): the Triton kernel against torch's argmax.

CPU: the kernel under `TRITON_INTERPRET=1` in a subprocess (the variable must be set before the
kernel is defined), on fresh random logits with ties, NaN and all -inf rows, vocabularies that are
one slice and many, and two calls in a row (the row counters go back to zero). GPU: the 30B's
vocabulary at decode batch sizes."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from compiled.runtime import argmax as am  # noqa: E402
from tests.linear.test_linear_kernel import run_interpreted  # noqa: E402

CASES = [(1, 97), (3, 4096), (2, 4096 * 3 + 5), (5, 151936)]


def _logits(B: int, V: int, seed: int) -> torch.Tensor:
    x = torch.randn(B, V, generator=torch.Generator().manual_seed(seed))
    x[0, V // 2] = x[0, V - 1] = 50.0          # a tie across slices: the first index wins
    if B > 2:
        x[2, 7] = x[2, V - 3] = float("nan")   # NaN is the maximum, the first one wins
    if B > 3:
        x[3] = float("-inf")                   # nothing finite: index 0
    return x


def interpreted() -> dict:
    results = {}
    ws = am.ArgmaxWorkspace(8, torch.device("cpu"))
    for B, V in CASES:
        for call in range(2):
            x = _logits(B, V, 10 * call + V)
            got, want = am.argmax_triton(x, ws), am.argmax_ref(x)
            results[f"{B}x{V}_{call}"] = dict(got=got.tolist(), want=want.tolist())
    out = torch.full((3,), -1)
    am.argmax_triton(_logits(3, 5000, 1), ws, out=out)
    results["into_out"] = dict(got=out.tolist(), want=am.argmax_ref(_logits(3, 5000, 1)).tolist())
    # logits in bf16 (cuBLAS's head), stored widened to fp32 as they are read; NaN included
    x = _logits(3, 5000, 2).to(torch.bfloat16)
    widened = torch.full((3, 5000), 7.0)
    got = am.argmax_triton(x, ws, widened=widened)
    results["widened"] = dict(got=got.tolist(), want=am.argmax_ref(x.float()).tolist())
    results["widened_values"] = torch.allclose(widened, x.float(), rtol=0, atol=0, equal_nan=True)
    results["counters_clean"] = not ws.counters.any().item()
    return results


@pytest.fixture(scope="module")
def interpreted_results() -> dict:
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", [f"{B}x{V}_{c}" for B, V in CASES for c in range(2)] + ["into_out", "widened"])
def test_interpreted_kernel_matches_torch(interpreted_results, case):
    r = interpreted_results[case]
    assert r["got"] == r["want"], r


def test_interpreted_kernel_leaves_the_counters_at_zero(interpreted_results):
    assert interpreted_results["counters_clean"]


def test_interpreted_kernel_stores_the_logits_widened_to_fp32(interpreted_results):
    assert interpreted_results["widened_values"]


def test_limits_are_one_line_errors():
    ws = am.ArgmaxWorkspace(2, torch.device("cpu"))
    for bad in (torch.empty(1, am.CHUNK * am.MAX_CHUNKS + 1), torch.empty(3, 10), torch.empty(10, 2).t()):
        with pytest.raises(ValueError, match=r"argmax: logits \("):
            am.argmax_triton(bad, ws)
    x = torch.empty(2, 10, dtype=torch.bfloat16)
    for bad in (torch.empty(2, 10, dtype=torch.bfloat16), torch.empty(2, 11), torch.empty(10, 2).t()):
        with pytest.raises(ValueError, match=r"argmax: widened must be an fp32 \(2, 10\) tensor"):
            am.argmax_triton(x, ws, widened=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gpu_matches_torch_on_the_vocabulary(batch):
    g = torch.Generator(device="cuda").manual_seed(batch)
    ws = am.ArgmaxWorkspace(batch, torch.device("cuda"))
    for _ in range(3):
        x = torch.randn(batch, 151936, device="cuda", generator=g)
        x[0, 100] = x[0, 150000] = x.max() + 1
        assert torch.equal(am.argmax_triton(x, ws), x.argmax(-1))
        half, widened = x.bfloat16(), torch.empty_like(x)
        assert torch.equal(am.argmax_triton(half, ws, widened=widened), half.float().argmax(-1))
        assert torch.equal(widened, half.float())   # bf16 -> fp32 is exact
    assert not ws.counters.any()


if __name__ == "__main__":   # run by the fixture above under TRITON_INTERPRET=1
    print(json.dumps(interpreted()))
