"""compiled::linear and its skinny GEMM (Triton) against the torch reference; the skinny_linear pass.

CPU: the kernel runs under `TRITON_INTERPRET=1` in one subprocess (the variable only takes effect
for kernels defined after it is set, so it must not leak into this process); the subprocess runs
this file as a script and prints its results. The op's dispatch and the pass run in-process.
GPU (`-m gpu`): real Qwen3 shapes in bf16, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import compiled.linear.library  # noqa: E402,F401  (registers the ops)
import compiled.linear.ops as lin  # noqa: E402
from compiled.linear import NARROW_MAX_M, SKINNY_MAX_M  # noqa: E402
from compiled.linear.ops import SkinnyLinear, linear_ref  # noqa: E402
from tests.conftest import assert_same_math, child_env  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the output's scale (bf16 keeps 8 bits of it; the
    interpreter also truncates where the GPU rounds)."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()


# ----------------------------------------------------------------------------------------------
# Interpreted cases (run in the subprocess): (name, M, N, K, dtype, forced config or None)

CASES = [
    ("m1_n7_k5", 1, 7, 5, "float32", None),
    ("m3_n130_k200", 3, 130, 200, "float32", None),
    ("m16_n48_k64", 16, 48, 64, "float32", None),
    ("m1_n1_k64_split2", 1, 1, 64, "float32", (16, 16, 2)),
    ("m3_n130_k200_split4", 3, 130, 200, "float32", (32, 64, 4)),
    ("m16_n48_k200_split3_ragged", 16, 48, 200, "float32", (32, 16, 3)),
    ("m1_n130_k64_bf16", 1, 130, 64, "bfloat16", None),
    ("m16_n7_k200_bf16", 16, 7, 200, "bfloat16", None),
    ("m3_n48_k5_bf16_split2", 3, 48, 5, "bfloat16", (16, 16, 2)),
    ("m16_n130_k200_bf16_split4", 16, 130, 200, "bfloat16", (32, 64, 4)),
    # a narrow weight (the router) takes up to NARROW_MAX_M rows, in 16-row tiles
    ("m29_n100_k200_split4", 29, 100, 200, "float32", (32, 64, 4)),
    ("m50_n7_k200_split2", 50, 7, 200, "float32", (16, 64, 2)),
    ("m64_n100_k64_bf16", 64, 100, 64, "bfloat16", None),
    ("m24_n128_k256_bf16", 24, 128, 256, "bfloat16", None),
    # the GEMV mode (one row; the default for M = 1 below the LM head's width): ragged N and K,
    # split K, and a K range shorter than one step
    ("gemv_m1_n13_k200", 1, 13, 200, "float32", (8, 64, 1, 4, 1, True)),
    ("gemv_m1_n130_k200_bf16_split4", 1, 130, 200, "bfloat16", (8, 32, 4, 4, 1, True)),
    ("gemv_m1_n20_k5_split2", 1, 20, 5, "float32", (4, 16, 2, 4, 1, True)),
    # several rows (a forced config): a power of two, and 3 rows masked in a 4-row block
    ("gemv_m2_n13_k200_split2", 2, 13, 200, "float32", (2, 64, 2, 4, 1, True)),
    ("gemv_m3_n130_k200_bf16", 3, 130, 200, "bfloat16", (8, 64, 1, 4, 1, True)),
]


def _randn(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def kernel_case(M: int, N: int, K: int, dtype: str, config) -> dict:
    """Two calls on fresh inputs each: both must match (the second proves the split-K
    semaphores were put back to 0), and the semaphores must be all zero afterwards."""
    from compiled.linear import skinny_kernels as lk
    dt = getattr(torch, dtype)
    cfg = None if config is None else lk.SkinnyConfig(*config)
    errs = []
    for call in range(2):
        x = _randn((M, K), dt, 10 * call + 1)
        w = _randn((N, K), dt, 10 * call + 2)
        errs.append(max_err(lk.skinny_linear_triton(x, w, cfg), linear_ref(x.float(), w.float())))
    ws = lk.workspace.allocated(lk.SKINNY_KERNEL, torch.device("cpu"))
    clean = ws is None or not ws.semaphores.any().item()
    return dict(err=max(errs), tol=TOL[dt], clean=clean)


def op_case() -> dict:
    """The op's body with the Triton backend forced: a 3-D x of 2 x 3 rows and a strided x (rows
    of a wider tensor) go through the kernel. (Its first call through the dispatcher would import
    torch._dynamo, seconds here; the dispatch itself is tested in-process.)"""
    lin.set_backend("triton")
    w = _randn((40, 24), torch.float32, 3)
    x3 = _randn((2, 3, 24), torch.float32, 4)
    wide = _randn((5, 64), torch.float32, 5)[:, 8:32]
    errs = [max_err(lin.dispatch(x, w), linear_ref(x, w)) for x in (x3, wide)]
    shape_ok = tuple(lin.dispatch(x3, w).shape) == (2, 3, 40)
    return dict(err=max(errs) if shape_ok else float("inf"), tol=TOL[torch.float32], clean=True)


def fp32_out_case() -> dict:
    """bf16 x into an fp32 `out` (the LM head's logits): the same values as the kernel's bf16
    output, exactly, with and without split-K, through the op's body too."""
    from compiled.linear import skinny_kernels as lk
    x, w = _randn((3, 200), torch.bfloat16, 6), _randn((130, 200), torch.bfloat16, 7)
    diffs = []
    for rows, cfg in ((x, lk.SkinnyConfig(32, 64, 1)), (x, lk.SkinnyConfig(32, 64, 4)),
                      (x[:1], lk.SkinnyConfig(8, 64, 2, gemv=True))):
        out = torch.full((rows.shape[0], 130), float("nan"))
        lk.skinny_linear_triton(rows, w, cfg, out=out)
        diffs.append((out - lk.skinny_linear_triton(rows, w, cfg).float()).abs().max().item())
    lin.set_backend("triton")
    out = torch.full((3, 130), float("nan"))
    diffs.append((lin.dispatch(x, w, out=out) - lin.dispatch(x, w).float()).abs().max().item())
    return dict(err=max(diffs), tol=0.0, clean=True)


def run_interpreted(script: str) -> dict[str, dict]:
    """Run a test file as a script under TRITON_INTERPRET=1 (default linear backend); the JSON
    its last line prints."""
    env = child_env(TRITON_INTERPRET="1", COMPILED_LINEAR_BACKEND=None)
    proc = subprocess.run([sys.executable, os.path.abspath(script)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict]:
    return run_interpreted(__file__)


@pytest.mark.parametrize("name", [c[0] for c in CASES] + ["op_forced_triton", "fp32_out"])
def test_interpreted_kernel_matches_reference(interpreted_results, name):
    r = interpreted_results[name]
    assert r["err"] <= r["tol"] and r["clean"], r


# ----------------------------------------------------------------------------------------------
# Dispatch, validation and the heuristic (in-process, no kernel launched)

@pytest.fixture
def backend():
    before = lin.BACKEND.name
    yield lin.set_backend
    lin.set_backend(before)


@pytest.fixture
def kernel_spy(monkeypatch):
    """Replaces the kernel by the reference and records each call's row count."""
    from compiled.linear import skinny_kernels
    calls = []

    def spy(x, weight, config=None, out=None):
        calls.append(x.shape[0])
        return linear_ref(x, weight) if out is None else out.copy_(linear_ref(x, weight))
    monkeypatch.setattr(skinny_kernels, "skinny_linear_triton", spy)
    return calls


def test_cpu_default_and_large_m_use_the_reference(backend, kernel_spy):
    backend("auto")
    w, narrow = torch.randn(130, 6), torch.randn(8, 6)
    for m in (1, SKINNY_MAX_M, SKINNY_MAX_M + 1):
        x = torch.randn(m, 6)
        assert not lin.use_kernel(x, w)
        assert torch.equal(torch.ops.compiled.linear(x, w), linear_ref(x, w))
    backend("triton")
    assert lin.use_kernel(torch.randn(SKINNY_MAX_M, 6), w)
    assert not lin.use_kernel(torch.randn(SKINNY_MAX_M + 1, 6), w)
    assert lin.use_kernel(torch.randn(NARROW_MAX_M, 6), narrow)             # a narrow weight: more rows
    assert not lin.use_kernel(torch.randn(NARROW_MAX_M + 1, 6), narrow)
    assert not lin.use_kernel(torch.randn(6, 3).t(), w)                     # x's last dim strided
    assert not lin.use_kernel(torch.randn(3, 6, dtype=torch.float64), w.double())
    torch.ops.compiled.linear(torch.randn(2, 3, 6), w)                      # 6 rows: the kernel
    torch.ops.compiled.linear(torch.randn(SKINNY_MAX_M + 1, 6), w)          # the reference
    backend("torch")
    torch.ops.compiled.linear(torch.randn(1, 6), w)
    assert kernel_spy == [6]


def test_bad_shapes_and_backend_are_one_line_errors(backend):
    with pytest.raises(ValueError, match=r"x \(3, 5\) @ weight \(8, 6\)\.T"):
        torch.ops.compiled.linear(torch.randn(3, 5), torch.randn(8, 6))
    with pytest.raises(ValueError, match=r"x \(3, 5\) @ weight \(8, 6\)\.T"):   # the fake (tracing)
        torch.ops.compiled.linear(torch.empty(3, 5, device="meta"), torch.empty(8, 6, device="meta"))
    with pytest.raises(ValueError, match="x is torch.float32, weight is torch.bfloat16"):
        torch.ops.compiled.linear(torch.randn(3, 6), torch.randn(8, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="COMPILED_LINEAR_BACKEND"):
        backend("cuda")


def test_out_takes_the_reference_off_the_kernel_and_checks_its_shape(backend):
    """`dispatch(..., out=)` where the kernel does not serve (CPU 'auto'): the reference's result,
    cast into out (fp32 logits of a bf16 head, as compute_logits asks); a wrong out is one line."""
    from compiled.runtime.model_runner import compute_logits
    backend("auto")
    x, w = torch.randn(3, 6, dtype=torch.bfloat16), torch.randn(8, 6, dtype=torch.bfloat16)
    out = torch.empty(3, 8)
    assert lin.dispatch(x, w, out=out) is out and torch.equal(out, linear_ref(x, w).float())
    head = SkinnyLinear(6, 8, bias=False, dtype=torch.bfloat16)
    assert torch.equal(compute_logits(head, x), head(x).float())
    plain = torch.nn.Linear(6, 8, bias=False, dtype=torch.bfloat16)
    assert torch.equal(compute_logits(plain, x), plain(x).float())
    with pytest.raises(ValueError, match=r"out \(3, 7\) for x \(3, 6\)"):
        lin.dispatch(x, w, out=torch.empty(3, 7))


def test_forced_config_is_validated():
    from compiled.linear import skinny_kernels as lk
    x, w = torch.randn(2, 32), torch.randn(8, 32)
    with pytest.raises(ValueError, match="block_n=24"):
        lk.skinny_linear_triton(x, w, lk.SkinnyConfig(24, 16, 1))
    with pytest.raises(ValueError, match="split_k"):
        lk.skinny_linear_triton(x, torch.randn(lk.WORKSPACE_COLS, 32), lk.SkinnyConfig(16, 16, 2))
    with pytest.raises(ValueError, match="output tiles"):   # more output tiles than semaphores
        lk.skinny_linear_triton(x[:1], torch.randn(4 * lk.SEMAPHORES, 32), lk.SkinnyConfig(2, 16, 2, gemv=True))
    with pytest.raises(ValueError, match="M=17 rows, at most 16 for a weight of 130 rows"):
        lk.skinny_linear_triton(torch.randn(17, 32), torch.randn(130, 32))
    with pytest.raises(ValueError, match=f"M={NARROW_MAX_M + 1} rows, at most {NARROW_MAX_M} for a weight of 8"):
        lk.skinny_linear_triton(torch.randn(NARROW_MAX_M + 1, 32), w)


# (N, K): qkv and o_proj of Qwen3-30B-A3B, its router, the LM head, Qwen3-0.6B's w13 and down.
REAL_SHAPES = [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048), (6144, 1024), (1024, 3072)]


@pytest.mark.parametrize("n,k", REAL_SHAPES)
def test_heuristic_fills_the_gpu_within_the_workspace(n, k):
    """The tensor-core tiles (2-16 rows)."""
    from compiled.linear import skinny_kernels as lk
    cfg = lk.skinny_config(2, n, k, 132)
    lk.check_config(cfg, SKINNY_MAX_M, n)
    programs = -(-n // cfg.block_n) * cfg.split_k
    assert programs >= 64 and k // cfg.split_k >= min(k, lk.MIN_K_PER_SPLIT)
    assert n * cfg.split_k <= max(n, lk.SPLIT_COLUMNS_PER_SM * 132)
    wide = n >= 64 * lk.WIDE_PROGRAMS_PER_SM * 132
    if wide:                                     # the LM head: wide blocks, no split
        assert cfg.block_n == lk.MAX_BLOCK_N and cfg.split_k == 1
    if n <= 2048:                                # router, o_proj, down: too few column blocks alone
        assert cfg.split_k > 1
    # cuBLAS keeps the mid-size single-pass shapes (qkv 5120, gate/up 6144), measured no slower
    assert lk.beats_cublas(cfg, n, 132) == (wide or n <= 2048)
    # with a prologue (never the wide LM head), more splits until each program has at most the
    # bound's K steps or the split is at its own bounds; never fewer than without
    fused = lk.skinny_config(2, n, k, 132, lk.PROLOGUE_MAX_STEPS)
    lk.check_config(fused, SKINNY_MAX_M, n)
    assert fused.split_k >= cfg.split_k and fused[:2] == cfg[:2]
    steps = -(-k // (fused.split_k * fused.block_k))
    assert wide or steps <= lk.PROLOGUE_MAX_STEPS or fused.split_k * 2 > min(lk.MAX_SPLIT_K, k // lk.MIN_K_PER_SPLIT)


@pytest.mark.parametrize("n,k", REAL_SHAPES)
def test_one_row_takes_the_gemv_mode(n, k):
    """One row: the GEMV mode below the LM head's width (chosen over cuBLAS too), with one
    column a program and no split where two columns would leave half the SMs idle (the router)."""
    from compiled.linear import skinny_kernels as lk
    cfg = lk.skinny_config(1, n, k, 132)
    lk.check_config(cfg, 1, n)
    wide = n >= 64 * lk.WIDE_PROGRAMS_PER_SM * 132
    assert cfg.gemv != wide and lk.beats_cublas(cfg, n, 132)
    if wide:
        assert cfg == lk.skinny_config(2, n, k, 132)
        return
    blocks = -(-n // cfg.block_n)
    assert (cfg.split_k > 1) == (blocks < 66) and blocks * cfg.split_k >= 66
    assert blocks * cfg.split_k <= 132 or cfg.split_k == 1
    longest = lk.NARROW_GEMV_MAX_BLOCK_K if cfg.block_n == 1 and cfg.split_k == 1 else lk.GEMV_MAX_BLOCK_K
    assert cfg.block_k <= longest and k // cfg.split_k >= lk.MIN_K_PER_SPLIT
    assert lk.skinny_config(1, n, k, 132, lk.PROLOGUE_MAX_STEPS) == cfg
    if n == 128 and k == 2048:   # the 30B's router: its row in one step
        assert cfg == lk.SkinnyConfig(1, 2048, 1, lk.GEMV_NUM_WARPS, 1, gemv=True)


@pytest.mark.parametrize("m,split,split_bare", [(17, 8, 8), (32, 8, 8), (33, 4, 8), (48, 4, 8), (64, 4, 8)])
def test_a_narrow_weight_past_one_tile_splits_k_to_about_a_program_an_sm(m, split, split_bare):
    """The 30B's router (N 128, K 2048) at 17-64 rows: 16-row tiles, NARROW_BLOCK_K steps, 16
    columns a program after its norm and 32 without, the largest power-of-two split whose grid
    stays within the 132 SMs."""
    from compiled.linear import skinny_kernels as lk
    for steps, block_n, want in ((lk.PROLOGUE_MAX_STEPS, 16, split), (0, 32, split_bare)):
        cfg = lk.skinny_config(m, 128, 2048, 132, steps)
        lk.check_config(cfg, m, 128)
        assert cfg == lk.SkinnyConfig(block_n, lk.NARROW_BLOCK_K, want)
        programs = (128 // cfg.block_n) * -(-m // lk.row_tile(m, False)) * cfg.split_k
        assert programs <= 132 < 2 * programs or cfg.split_k * lk.NARROW_BLOCK_K == 2048
    # a short K: each split at least one step
    assert lk.skinny_config(64, 128, 512, 132, lk.PROLOGUE_MAX_STEPS).split_k == 2


def test_one_row_fp8_gemvs_without_a_prologue_or_split_load_their_whole_k_range_first():
    """The 30B's FP8 qkv and o_proj at one row: every K step before the PDL wait (4 each, 16 KB a
    program); not with a prologue, a K split, more rows, bf16 weights (no runs of
    products) or more than PRELOAD_THREAD_BYTES a thread (16 KB over one warp)."""
    from compiled.linear import skinny_kernels as lk
    for n, k in ((5120, 2048), (2048, 4096)):
        cfg = lk.skinny_config(1, n, k, 132, weight_bytes=1)
        assert lk.preload_steps(cfg, 1, k, 16, False) == 4
        assert lk.preload_steps(cfg, 1, k, 16, True) == 0
        assert lk.preload_steps(cfg, 1, k, 1, False) == 0
        assert lk.preload_steps(cfg._replace(split_k=2), 1, k, 16, False) == 0
        assert cfg.block_n * k == 16 * 1024
        assert lk.preload_steps(cfg._replace(num_warps=1), 1, k, 16, False) == 0
    cfg = lk.SkinnyConfig(2, 64, 1, gemv=True)
    assert lk.preload_steps(cfg, 1, 200, 16, False) == 4 and lk.preload_steps(cfg, 1, 300, 16, False) == 0
    assert lk.preload_steps(cfg, 2, 200, 16, False) == 0


# ----------------------------------------------------------------------------------------------
# The pass on the demo models

@pytest.mark.parametrize("model", ["dense", "moe"])
def test_pass_routes_every_linear_and_keeps_outputs(model):
    from compiled.demo import DENSE_MODEL, MOE_MODEL
    from compiled.graphs.config import ModelConfig
    from compiled.passes.manager import DEFAULT_PASSES
    from tests.passes.test_passes import _linear_calls, _passed, _plain, _run
    cfg = ModelConfig.from_pretrained(DENSE_MODEL if model == "dense" else MOE_MODEL)
    plain = _plain(cfg)
    before = _passed(cfg, plain, [p for p in DEFAULT_PASSES if p != "skinny_linear"])
    after = _passed(cfg, plain, list(DEFAULT_PASSES))
    calls = _linear_calls(after)
    per_layer = {False: ("qkv_proj", "o_proj", "w13", "down_proj"), True: ("qkv_proj", "o_proj", "gate")}
    expected = {f"model.layers.{i}.{sub}.{leaf}" for i in range(cfg.num_hidden_layers)
                for leaf in per_layer[cfg.is_moe_layer(i)] for sub in ("self_attn", "mlp")
                if (sub == "self_attn") == (leaf in ("qkv_proj", "o_proj"))}
    assert set(calls) == expected and all(n.op == "call_function" for n in calls.values())
    assert isinstance(after.lm_head, SkinnyLinear) and not isinstance(before.lm_head, SkinnyLinear)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 5, 11)]
    decode = torch.randint(0, cfg.vocab_size, (3,), generator=gen).tolist()
    h_before, h_after = _run(before, cfg, prompts, decode), _run(after, cfg, prompts, decode)
    assert_same_math(h_after, h_before)
    assert_same_math(after.lm_head(h_after), before.lm_head(h_before))


def test_pass_counts_rewrites_and_leaves_biased_linears():
    from compiled.graphs.config import ModelConfig
    from compiled.graphs.trace import meta_model, trace
    from compiled.passes.manager import run_passes
    from tests.passes.test_passes import CONFIGS
    cfg = ModelConfig.from_dict(CONFIGS["dense_mqa_bias"])
    meta = meta_model(cfg, torch.float32)
    record = run_passes(trace(meta), meta.checkpoint_map(), ["skinny_linear"]).records[0]
    assert record.rewrites == 3 * cfg.num_hidden_layers + 1      # gate, up, down per layer + LM head
    meta = meta_model(cfg, torch.float32)
    record = run_passes(trace(meta), meta.checkpoint_map(), ["fuse_qkv", "fuse_w13", "skinny_linear"]).records[-1]
    assert record.rewrites == 2 * cfg.num_hidden_layers + 1      # w13, down per layer + LM head


# ----------------------------------------------------------------------------------------------
# GPU: real sizes, bf16

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k", REAL_SHAPES)
def test_gpu_real_shapes_match_cublas(backend, m, n, k):
    backend("triton")   # the kernel at every shape, including those 'auto' leaves to cuBLAS
    g = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5)
    assert lin.use_kernel(x, w)
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert max_err(torch.ops.compiled.linear(x, w), ref) <= 1e-2      # also readies the workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.compiled.linear(x, w)
    for seed in range(3):                                                # replays reuse the semaphores
        x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g.manual_seed(seed)))
        graph.replay()
        assert max_err(y, torch.nn.functional.linear(x.float(), w.float())) <= 1e-2
    from compiled.linear import skinny_kernels as lk
    ws = lk.workspace.allocated(lk.SKINNY_KERNEL, x.device)
    assert ws is None or not ws.semaphores.any().item()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_lm_head_writes_fp32_logits_as_its_bf16_output(backend, m):
    """The LM head's shape into an fp32 buffer: bit for bit the bf16 output, upcast."""
    backend("auto")
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(151936, 2048, device="cuda", dtype=torch.bfloat16, generator=g) * 2048 ** -0.5
    assert lin.use_kernel(x, w)
    out = torch.empty(m, 151936, device="cuda")
    lin.dispatch(x, w, out=out)
    assert torch.equal(out, lin.dispatch(x, w).float())


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", [(1, 2048), (5, 128)])
def test_gpu_dependent_launches_wait_for_their_input(backend, m, n):
    """Programmatic dependent launch: each skinny GEMM of a chain starts while the one before it
    ends but must read x only after that one has written it. A
    captured chain of 24 split-K calls, each reading the last's output, matches the torch chain."""
    from compiled.triton_utils import use_pdl
    backend("triton")
    assert use_pdl(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    g = torch.Generator(device="cuda").manual_seed(n)
    ws = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g) * n ** -0.5 for _ in range(24)]
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)

    def chain(y, op):
        for w in ws:
            y = op(y, w)
        return y

    torch.ops.compiled.linear(x, ws[0])   # readies the workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x, torch.ops.compiled.linear)
    for seed in range(3):
        x.copy_(torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g.manual_seed(seed)))
        graph.replay()
        ref = chain(x, lambda y, w: torch.nn.functional.linear(y.float(), w.float()).to(torch.bfloat16))
        assert max_err(out, ref) <= 5e-2


if __name__ == "__main__":   # run by the fixture above under TRITON_INTERPRET=1
    results = {name: kernel_case(M, N, K, dt, cfg) for name, M, N, K, dt, cfg in CASES}
    results["op_forced_triton"] = op_case()
    results["fp32_out"] = fp32_out_case()
    print(json.dumps(results))
