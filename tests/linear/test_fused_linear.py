"""compiled::add_rms_norm_linear and compiled::silu_mul_linear (the skinny GEMM's prologues, the
add + RMSNorm row kernel) against their torch references; dispatch and errors.

CPU: the kernels run under `TRITON_INTERPRET=1` in one subprocess that runs this file as a script
(as tests/linear/test_linear_kernel.py does). GPU (`-m gpu`): Qwen3 shapes in bf16, eagerly and replayed
from a CUDA graph. The passes that route the graph here are tested in tests/passes/test_passes.py."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import compiled.linear.library  # noqa: E402,F401  (registers the ops)
import compiled.linear.ops as lin  # noqa: E402
from compiled.linear import fused as fl  # noqa: E402
from tests.linear.test_linear_kernel import TOL, max_err, run_interpreted  # noqa: E402

# (name, M, N, K, dtype, forced (block_n, block_k, split_k) or None, keep_normed)
NORM_CASES = [
    ("norm_m1_n7_k5", 1, 7, 5, "float32", None, True),
    ("norm_m3_n130_k200_split4", 3, 130, 200, "float32", (32, 64, 4), True),
    ("norm_m16_n48_k200_split3_ragged", 16, 48, 200, "float32", (32, 16, 3), False),
    ("norm_m5_n40_k96_bf16_split2", 5, 40, 96, "bfloat16", (16, 32, 2), True),
    ("norm_m2_n33_k64_fp16", 2, 33, 64, "float16", None, True),
    # a narrow weight (the router) up to NARROW_MAX_M rows: 16-row tiles, split K
    ("norm_m29_n100_k200_split4", 29, 100, 200, "float32", (32, 64, 4), True),
    ("norm_m45_n100_k200_split4", 45, 100, 200, "float32", (32, 64, 4), True),
    ("norm_m64_n128_k256_bf16", 64, 128, 256, "bfloat16", None, True),
    ("norm_m24_n128_k256_bf16", 24, 128, 256, "bfloat16", None, True),
    # the GEMV mode (one row)
    ("norm_gemv_m1_n130_k200_split4", 1, 130, 200, "float32", (8, 32, 4, 4, 1, True), True),
    ("norm_gemv_m1_n40_k96_bf16_split2", 1, 40, 96, "bfloat16", (1, 32, 2, 4, 1, True), False),
    ("norm_gemv_m3_n40_k200_split2", 3, 40, 200, "float32", (2, 64, 2, 4, 1, True), True),
]
# (name, M, N, K, dtype, forced config or None): gate_up is [M, 2K]
SILU_CASES = [
    ("silu_m1_n7_k5", 1, 7, 5, "float32", None),
    ("silu_m3_n130_k200_split4", 3, 130, 200, "float32", (32, 64, 4)),
    ("silu_m16_n48_k64_bf16_split2", 16, 48, 64, "bfloat16", (16, 16, 2)),
    ("silu_gemv_m1_n48_k200_split2", 1, 48, 200, "float32", (8, 64, 2, 4, 1, True)),
    ("silu_gemv_m1_n33_k64_bf16", 1, 33, 64, "bfloat16", None),
    ("silu_gemv_m2_n48_k200", 2, 48, 200, "float32", (4, 64, 1, 4, 1, True)),
]
# (name, prologue, T, K, dtype): the prologues' own launches, for what the skinny GEMM does not take
ROW_CASES = [("rows_t3_k5", "norm", 3, 5, "float32"), ("rows_t7_k200_fp16", "norm", 7, 200, "float16"),
             ("rows_t2_k2048_bf16", "norm", 2, 2048, "bfloat16"),
             ("rows_silu_t5_k1500_bf16", "silu", 5, 1500, "bfloat16")]   # two column blocks


def _randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _residual(M, K, dt, seed):
    """x and delta with a different scale per row, so each row has its own 1 / rms."""
    rows = torch.linspace(0.3, 4.0, M)[:, None]
    return _randn((M, K), dt, seed, rows), _randn((M, K), dt, seed + 1, rows)


def norm_case(M, N, K, dtype, config, keep_normed) -> dict:
    """Two calls on fresh inputs (the second proves the semaphores were put back): y, h and the
    kept normalised rows against the reference; semaphores all zero afterwards."""
    from compiled.linear import skinny_kernels as lk
    dt = getattr(torch, dtype)
    cfg = None if config is None else lk.SkinnyConfig(*config)
    errs = []
    for call in range(2):
        x, delta = _residual(M, K, dt, 10 * call)
        nw = _randn((K,), dt, 10 * call + 5, 0.5) + 1
        w = _randn((N, K), dt, 10 * call + 6)
        y, h, normed = lk.add_rms_norm_linear_triton(x, delta, nw, 1e-6, w, keep_normed, cfg)
        ref_y, ref_h, ref_normed = fl.add_rms_norm_linear_ref(x.float(), delta.float(), nw.float(), 1e-6, w.float())
        errs += [max_err(y, ref_y), max_err(h, ref_h)]
        errs.append(max_err(normed, ref_normed) if keep_normed else float(normed is not None))
    ws = lk.workspace.allocated(lk.SKINNY_KERNEL, torch.device("cpu"))
    clean = ws is None or not ws.semaphores.any().item()
    return dict(err=max(errs), tol=TOL[dt], clean=clean)


def silu_case(M, N, K, dtype, config) -> dict:
    from compiled.linear import skinny_kernels as lk
    dt = getattr(torch, dtype)
    cfg = None if config is None else lk.SkinnyConfig(*config)
    errs = []
    for call in range(2):
        gate_up = _randn((M, 2 * K), dt, 10 * call + 1, 2.0)
        w = _randn((N, K), dt, 10 * call + 2)
        errs.append(max_err(lk.silu_mul_linear_triton(gate_up, w, cfg), fl.silu_mul_linear_ref(gate_up.float(), w.float())))
    ws = lk.workspace.allocated(lk.SKINNY_KERNEL, torch.device("cpu"))
    clean = ws is None or not ws.semaphores.any().item()
    return dict(err=max(errs), tol=TOL[dt], clean=clean)


def rows_case(prologue, T, K, dtype) -> dict:
    from compiled.functional import add_rms_norm_ref, silu_and_mul_ref
    from compiled.linear.prologue_kernels import add_rms_norm_triton, silu_and_mul_triton
    dt = getattr(torch, dtype)
    if prologue == "silu":   # over [T, 2K]
        gate_up = _randn((T, 2 * K), dt, 3, 3.0)
        return dict(err=max_err(silu_and_mul_triton(gate_up), silu_and_mul_ref(gate_up.float())), tol=TOL[dt],
                    clean=True)
    x, delta = _residual(T, K, dt, 3)
    nw = _randn((K,), dt, 4, 0.5) + 1
    h, normed = add_rms_norm_triton(x, delta, nw, 1e-6)
    ref_h, ref_normed = add_rms_norm_ref(x.float(), delta.float(), nw.float(), 1e-6)
    return dict(err=max(max_err(h, ref_h), max_err(normed, ref_normed)), tol=TOL[dt], clean=True)


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict]:
    return run_interpreted(__file__)


@pytest.mark.parametrize("name", [c[0] for c in NORM_CASES + SILU_CASES + ROW_CASES])
def test_interpreted_kernel_matches_reference(interpreted_results, name):
    r = interpreted_results[name]
    assert r["err"] <= r["tol"] and r["clean"], r


# ----------------------------------------------------------------------------------------------
# The ops on CPU (the references) and their errors

def test_cpu_ops_are_the_references():
    x, delta = _residual(4, 24, torch.float32, 0)
    nw, w = _randn((24,), torch.float32, 2) + 1, _randn((40, 24), torch.float32, 3)
    ref = fl.add_rms_norm_linear_ref(x, delta, nw, 1e-6, w)
    y, h, normed = torch.ops.compiled.add_rms_norm_linear(x, delta, nw, 1e-6, w, True)
    assert all(torch.equal(a, b) for a, b in zip((y, h, normed), ref))
    assert torch.ops.compiled.add_rms_norm_linear(x, delta, nw, 1e-6, w, False)[2].numel() == 0
    gate_up = _randn((4, 48), torch.float32, 4)
    assert torch.equal(torch.ops.compiled.silu_mul_linear(gate_up, w), fl.silu_mul_linear_ref(gate_up, w))


def test_bad_shapes_are_one_line_errors():
    x, w = torch.randn(3, 24), torch.randn(40, 24)
    with pytest.raises(ValueError, match=r"delta \(3, 23\) torch.float32 does not match x \(3, 24\)") as e:
        torch.ops.compiled.add_rms_norm_linear(x, torch.randn(3, 23), torch.ones(24), 1e-6, w, False)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"norm weight \(23,\), expected \(24,\)"):
        torch.ops.compiled.add_rms_norm_linear(x, x, torch.ones(23), 1e-6, w, False)
    with pytest.raises(ValueError, match=r"gate_up \(3, 24\) @ weight \(40, 24\).T: expected gate_up \[T, 2K\]"):
        torch.ops.compiled.silu_mul_linear(x, w)
    with pytest.raises(ValueError, match="gate_up is torch.float16, weight is torch.float32"):
        torch.ops.compiled.silu_mul_linear(torch.randn(3, 48).half(), w)


# ----------------------------------------------------------------------------------------------
# GPU: Qwen3 shapes in bf16, under the default backend

REAL_NORM = [(128, 2048, True), (5120, 2048, False), (6144, 1024, False)]   # 30B router, 30B qkv, 0.6B w13


def _cuda_inputs(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.linspace(0.3, 4.0, m, device="cuda")[:, None]
    x = (torch.randn(m, k, device="cuda", generator=g) * rows).bfloat16()
    delta = (torch.randn(m, k, device="cuda", generator=g) * rows).bfloat16()
    nw = (torch.rand(k, device="cuda", generator=g) + 0.5).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    return x, delta, nw, w


def _check_norm(out, x, delta, nw, w, keep):
    y, h, normed = out
    ref_y, ref_h, ref_normed = fl.add_rms_norm_linear_ref(x, delta, nw, 1e-6, w)
    assert torch.equal(h, ref_h)                      # the add rounds as torch's does
    assert max_err(y, ref_y.float()) <= 1.6e-2
    if keep:
        assert max_err(normed, ref_normed) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("n,k,keep", REAL_NORM)
def test_gpu_add_rms_norm_linear_eager_and_graph(m, n, k, keep):
    """One row runs the fused kernel (its GEMV mode), 2-32 rows where the skinny GEMM takes the
    bare linear (the router), else the row kernel + cuBLAS (qkv, w13 at 8-16 rows, and 64 rows);
    both replayed from a CUDA graph on fresh inputs."""
    x, delta, nw, w = _cuda_inputs(m, n, k, m * n + k)
    assert lin.use_kernel(x, w) == (m == 1 or m <= lin.max_rows(n) and n == 128)
    op = torch.ops.compiled.add_rms_norm_linear
    _check_norm(op(x, delta, nw, 1e-6, w, keep), x, delta, nw, w, keep)   # also readies the workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, delta, nw, 1e-6, w, keep)
    for seed in range(2):
        for dst, src in zip((x, delta), _cuda_inputs(m, n, k, 100 + seed)):
            dst.copy_(src)
        graph.replay()
        _check_norm(out, x, delta, nw, w, keep)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gpu_silu_mul_linear_eager_and_graph(m):
    """The 0.6B shape's down projection: the fused kernel up to 16 rows, the reference beyond."""
    g = torch.Generator(device="cuda").manual_seed(m)
    gate_up = torch.randn(m, 2 * 3072, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1024, 3072, device="cuda", generator=g) * 3072 ** -0.5).bfloat16()
    ref = fl.silu_mul_linear_ref(gate_up, w).float()
    assert max_err(torch.ops.compiled.silu_mul_linear(gate_up, w), ref) <= 1.6e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.compiled.silu_mul_linear(gate_up, w)
    gate_up.copy_(torch.randn(m, 2 * 3072, device="cuda", generator=g).bfloat16())
    graph.replay()
    assert max_err(out, fl.silu_mul_linear_ref(gate_up, w).float()) <= 1.6e-2


if __name__ == "__main__":   # run by the fixture above under TRITON_INTERPRET=1
    results = {c[0]: norm_case(*c[1:]) for c in NORM_CASES}
    results.update({c[0]: silu_case(*c[1:]) for c in SILU_CASES})
    results.update({c[0]: rows_case(*c[1:]) for c in ROW_CASES})
    print(json.dumps(results))
