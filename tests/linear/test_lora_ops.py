"""compiled::lora_shrink / compiled::lora_expand: the torch references against a naive per-token loop,
the Triton kernels against the references, validation, tracing and compiling.

CPU: the kernels run under `TRITON_INTERPRET=1` in one subprocess (this file run as a script,
printing its results as JSON; see tests/linear/test_linear_kernel.py); the references, the
dispatch and the checks run in-process. GPU (`-m gpu`): Qwen3-30B-A3B's attention projections
(and dense MLP widths) at R = 16, S = 8, in bf16, eagerly, with no host sync, and replayed from a
CUDA graph."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import compiled.linear.lora as lora  # noqa: E402
from compiled.linear.lora import lora_expand_ref, lora_shrink_ref  # noqa: E402
from tests.linear.test_linear_kernel import max_err, run_interpreted  # noqa: E402
from tests.conftest import capture_without_host_sync  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
SLOTS_7 = [0, -1, 2, 1, 0, -1, 2]


def problem(T, IN, slices, R, S, dtype, seed, slots=None):
    """Fresh non-zero inputs: x, a, b, scale, slot, y (slots drawn from -1..S-1 unless given)."""
    g = torch.Generator().manual_seed(seed)
    N, OUT = len(slices), sum(slices)
    x = torch.randn(T, IN, generator=g).to(dtype)
    a = (torch.randn(S, N * R, IN, generator=g) / IN ** 0.5).to(dtype)
    b = (torch.randn(S, OUT, R, generator=g) / R ** 0.5).to(dtype)
    scale = torch.rand(S, N, generator=g) + 0.5
    if slots is None:
        slot = torch.randint(-1, S, (T,), generator=g, dtype=torch.int32)
    else:
        slot = torch.tensor(slots, dtype=torch.int32)
    y = torch.randn(T, OUT, generator=g).to(dtype)
    return x, a, b, scale, slot, y


def naive_shrink(x, a, slot):
    out = torch.zeros(x.shape[0], a.shape[1])
    for t in range(x.shape[0]):
        s = int(slot[t])
        if 0 <= s < a.shape[0]:
            for n in range(a.shape[1]):
                out[t, n] = (a[s, n].double() * x[t].double()).sum()
    return out


def naive_expand(y, s, b, scale, slot, slices):
    R = b.shape[2]
    out = y.double().clone()
    for t in range(y.shape[0]):
        sl = int(slot[t])
        if not 0 <= sl < b.shape[0]:
            continue
        col = 0
        for i, width in enumerate(slices):
            for c in range(col, col + width):
                out[t, c] += float(scale[sl, i]) * (s[t, i * R:(i + 1) * R].double() * b[sl, c].double()).sum()
            col += width
    return out


# ----------------------------------------------------------------------------------------------
# Interpreted cases (run in the subprocess): (name, T, IN, slices, R, S, dtype, slots, shrink cfg, expand cfg)

CASES = [
    ("t7_in45_qkv_fp32", 7, 45, [17, 9, 9], 8, 3, "float32", SLOTS_7, None, None),
    ("t7_in45_qkv_bf16", 7, 45, [17, 9, 9], 8, 3, "bfloat16", SLOTS_7, None, None),
    ("t7_in45_qkv_fp16", 7, 45, [17, 9, 9], 8, 3, "float16", SLOTS_7, None, None),
    # 16-column blocks: expand block 1 crosses all three slices; shrink K in 16-steps with a tail
    ("t7_in45_qkv_small_blocks", 7, 45, [17, 9, 9], 8, 3, "float32", SLOTS_7, (16, 16, 16), (16, 16, 16)),
    # three token blocks, slots outside [0, S) act as no adapter, K a multiple of the step
    ("t40_in64_gate_up_blocks", 40, 64, [24, 24], 16, 2, "float32", None, (16, 16, 32), (16, 32, 16)),
    ("t40_in64_gate_up_bf16", 40, 64, [24, 24], 16, 2, "bfloat16", None, (16, 16, 32), (16, 32, 16)),
    # a prefill: every row with an adapter on one slot (the expand's one-slot dot), three without
    ("t40_in64_one_adapter", 40, 64, [24, 24], 16, 2, "float32", [1] * 5 + [-1] + [1] * 20 + [-1, -1] + [1] * 12,
     (16, 16, 32), (16, 32, 16)),
    # one token, one slice (o / down), rank 5 padded to a 16-wide tile, one slot
    ("t1_in33_o_rank5", 1, 33, [20], 5, 1, "float32", [0], None, None),
    ("t3_all_without_adapter", 3, 45, [17, 9, 9], 8, 3, "bfloat16", [-1, -1, -1], None, None),
    # split K: forced (ragged last split, 4 slots of one block reduced by their own semaphores),
    # and the heuristic's at two tokens (4 splits of 256); the expand stacks 4 slots in 16-wide K steps
    ("t7_in300_split4", 7, 300, [17, 9, 9], 8, 3, "float32", SLOTS_7, (16, 16, 32, 4), (16, 16, 16)),
    ("t2_in1024_default_split_bf16", 2, 1024, [17, 9, 9], 8, 3, "bfloat16", [1, -1], None, None),
    ("t0_empty", 0, 45, [17, 9, 9], 8, 3, "float32", [], None, None),
    # the shrink's GEMV mode: the heuristic's at one row (all of K in one step, or two with a
    # tail past GEMV_K_ELEMENTS), and forced at four rows of three slots, one out of range
    ("t1_in45_qkv_gemv_bf16", 1, 45, [17, 9, 9], 8, 3, "bfloat16", [2], None, None),
    ("t1_in5000_gemv_two_steps", 1, 5000, [16], 4, 2, "float32", [1], None, None),
    ("t4_in300_gemv_forced", 4, 300, [24, 24], 16, 3, "float32", [2, -1, 0, 3], (4, 2, 64, 1, 4, 1, True), None),
]


def kernel_case(T, IN, slices, R, S, dtype, slots, shrink_cfg, expand_cfg) -> dict:
    """The kernels against the references: the shrink (twice, on fresh x: the second call proves
    the split semaphores were put back to 0, and they must be all zero afterwards), then the
    expand of the reference's s (so each kernel is judged alone). Where a test draws slots, two
    of them are out of range (S and -7) and must act as no adapter. Rows without an adapter: s
    zero, y copied bit for bit."""
    from compiled.linear import lora_kernels as lk
    dt = getattr(torch, dtype)
    x, a, b, scale, slot, y = problem(T, IN, slices, R, S, dt, seed=T + IN + R, slots=slots)
    if slots is None:
        slot[3], slot[11] = S, -7
    scfg = None if shrink_cfg is None else lk.LoRAConfig(*shrink_cfg)
    ecfg = None if expand_cfg is None else lk.LoRAConfig(*expand_cfg)
    first = problem(T, IN, slices, R, S, dt, seed=T + IN + R + 1, slots=slots)[0]
    first_err = max_err(lk.lora_shrink_triton(first, a, slot, scfg), lora_shrink_ref(first, a, slot)) if T else 0.0
    s = lk.lora_shrink_triton(x, a, slot, scfg)
    s_ref = lora_shrink_ref(x, a, slot)
    ws = lk.workspace.allocated(lk.SHRINK_KERNEL, torch.device("cpu"))
    clean = ws is None or not ws.semaphores.any().item()
    out = lk.lora_expand_triton(y, s_ref, b, scale, slot, slices, ecfg)
    out_ref = lora_expand_ref(y, s_ref, b, scale, slot, slices)
    none = (slot < 0) | (slot >= S)
    ok = (clean and s.dtype == torch.float32 and s.shape == (T, len(slices) * R) and out.dtype == dt
          and out.shape == y.shape and bool((s[none] == 0).all()) and torch.equal(out[none], y[none]))
    if T == 0:
        return dict(err=0.0, tol=0.0, clean=ok)
    err = max(first_err, max_err(s, s_ref), max_err(out, out_ref))
    return dict(err=err, tol=TOL[dt], clean=ok)


def op_case() -> dict:
    """The op bodies with the Triton backend forced (through the kernels on CPU), a strided x."""
    lora.set_backend("triton")
    x, a, b, scale, slot, y = problem(7, 64, [17, 9, 9], 8, 3, torch.float32, 5, SLOTS_7)
    wide = torch.randn(7, 80)
    wide[:, 8:72] = x
    s = lora.shrink(wide[:, 8:72], a, slot)
    out = lora.expand(y, s, b, scale, slot, [17, 9, 9])
    s_ref = lora_shrink_ref(x, a, slot)
    err = max(max_err(s, s_ref), max_err(out, lora_expand_ref(y, s_ref, b, scale, slot, [17, 9, 9])))
    return dict(err=err, tol=TOL[torch.float32], clean=True)


# The skinny GEMM with the expand in its epilogue (compiled::linear_lora's kernel, the shrink
# given; tests/linear/test_lora_linear.py has the ops): (name, M, K,
# slices, R, S, dtype, slots, skinny config or None for the heuristic's). Slots S and -7: no adapter.
FUSED_CASES = [
    ("fused_m1_gemv_qkv_bf16", 1, 45, [17, 9, 9], 8, 3, "bfloat16", [2], None),
    ("fused_m3_gemv_forced_fp32", 3, 64, [24, 24], 16, 2, "float32", [1, -1, 0], (2, 32, 1, 4, 1, True)),
    ("fused_m7_tiles_cross_slices_fp32", 7, 45, [17, 9, 9], 8, 3, "float32", SLOTS_7, (16, 16, 1)),
    ("fused_m7_split4_bf16", 7, 300, [17, 9, 9], 8, 3, "bfloat16", SLOTS_7, (16, 32, 4)),
    ("fused_m5_one_slot_o_rank5", 5, 33, [20], 5, 1, "float32", [0] * 5, None),
    ("fused_m4_out_of_range_fp16", 4, 40, [24, 8], 8, 3, "float16", [3, -7, 0, 1], None),
    ("fused_m4_no_adapter_bf16", 4, 40, [24, 8], 8, 3, "bfloat16", [-1] * 4, None),
]


def fused_case(M, K, slices, R, S, dtype, slots, config) -> dict:
    """`skinny_linear_lora_triton` against the references (linear, then the expand of the
    reference shrink); rows without an adapter bit for bit the plain skinny GEMM's."""
    from compiled.linear import lora_kernels as lk, skinny_kernels as sk
    from compiled.linear.ops import linear_ref
    dt = getattr(torch, dtype)
    x, a, b, scale, slot, _ = problem(M, K, slices, R, S, dt, seed=M + K + R, slots=slots)
    w = (torch.randn(sum(slices), K, generator=torch.Generator().manual_seed(K)) / K ** 0.5).to(dt)
    cfg = None if config is None else sk.SkinnyConfig(*config)
    s = lora_shrink_ref(x, a, slot)
    got = sk.skinny_linear_lora_triton(x, w, lk.LoRAArgs.of(s, b, scale, slot, slices), cfg)
    want = lora_expand_ref(linear_ref(x, w), s, b, scale, slot, slices)
    plain = sk.skinny_linear_triton(x, w, cfg)
    ws = sk.workspace.allocated(sk.SKINNY_KERNEL, torch.device("cpu"))
    none = (slot < 0) | (slot >= S)
    ok = (got.dtype == dt and got.shape == want.shape and torch.equal(got[none], plain[none])
          and (ws is None or not ws.semaphores.any().item()))
    return dict(err=max_err(got, want), tol=TOL[dt], clean=ok)


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict]:
    return run_interpreted(__file__)


@pytest.mark.parametrize("name", [c[0] for c in CASES + FUSED_CASES] + ["op_forced_triton"])
def test_interpreted_kernels_match_reference(interpreted_results, name):
    r = interpreted_results[name]
    assert r["err"] <= r["tol"] and r["clean"], r


# ----------------------------------------------------------------------------------------------
# The references (in-process)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_match_a_naive_loop(dtype):
    x, a, b, scale, slot, y = problem(7, 45, [17, 9, 9], 8, 3, dtype, 1, SLOTS_7)
    s = lora_shrink_ref(x, a, slot)
    want = naive_shrink(x, a, slot)
    assert s.dtype == torch.float32 and (s[1] == 0).all() and (s[5] == 0).all()
    torch.testing.assert_close(s, want, atol=1e-5, rtol=1e-5)
    out = lora_expand_ref(y, s, b, scale, slot, [17, 9, 9])
    assert out.dtype == dtype and torch.equal(out[1], y[1]) and torch.equal(out[5], y[5])
    exact = naive_expand(y, s, b, scale, slot, [17, 9, 9])
    assert (out.double() - y.double()).abs().max() > 0.1                   # the deltas are not small
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    else:   # one rounding of the fp32 sum to bf16
        assert ((out.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()


def test_one_slot_per_slice_uses_its_own_rank_block_and_scale():
    """A delta in one slice's A/B block shows only in that slice's columns, scaled by its scale."""
    x, a, b, scale, slot, y = problem(4, 16, [5, 3, 3], 4, 2, torch.float32, 2, [1, 1, 0, -1])
    a.zero_()
    b.zero_()
    a[1, 4:8] = torch.randn(4, 16)           # slot 1, slice 1 (k)
    b[1, 5:8] = torch.randn(3, 4)
    scale[1, 1] = 3.0
    out = lora_expand_ref(y, lora_shrink_ref(x, a, slot), b, scale, slot, [5, 3, 3])
    delta = out - y
    assert (delta[:2, 5:8].abs() > 0).all() and (delta[:, :5] == 0).all() and (delta[:, 8:] == 0).all()
    assert (delta[2:] == 0).all()
    want = 3.0 * (x[:2] @ a[1, 4:8].T) @ b[1, 5:8].T
    torch.testing.assert_close(delta[:2, 5:8], want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Ops: dispatch, validation, fake tensors, tracing, Inductor

@pytest.fixture
def backend():
    before = lora.BACKEND.name
    yield lora.set_backend
    lora.set_backend(before)


def test_cpu_auto_is_the_reference(backend):
    backend("auto")
    x, a, b, scale, slot, y = problem(7, 45, [17, 9, 9], 8, 3, torch.float32, 3, SLOTS_7)
    assert not lora.use_kernel(x)
    s = torch.ops.compiled.lora_shrink(x, a, slot)
    assert torch.equal(s, lora_shrink_ref(x, a, slot))
    out = torch.ops.compiled.lora_expand(y, s, b, scale, slot, [17, 9, 9])
    assert torch.equal(out, lora_expand_ref(y, s, b, scale, slot, [17, 9, 9]))
    assert out.data_ptr() != y.data_ptr()                                  # functional
    backend("triton")
    assert lora.use_kernel(x)


def _one_line(fn, match):
    with pytest.raises(ValueError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


def test_bad_shapes_are_one_line_errors(backend):
    x, a, b, scale, slot, y = problem(7, 45, [17, 9, 9], 8, 3, torch.float32, 4, SLOTS_7)
    s = lora_shrink_ref(x, a, slot)
    shrink, expand = torch.ops.compiled.lora_shrink, torch.ops.compiled.lora_expand
    _one_line(lambda: shrink(x[:, :44], a, slot), r"lora_shrink: x \(7, 44\), a \(3, 24, 45\)")
    _one_line(lambda: shrink(x, a.bfloat16(), slot), "x is torch.float32, a is torch.bfloat16")
    _one_line(lambda: shrink(x, a, slot.long()), r"slot \(7,\) torch.int64, expected \(7,\) torch.int32")
    _one_line(lambda: shrink(x, a, slot[:6]), r"slot \(6,\)")
    _one_line(lambda: expand(y, s, b, scale, slot, [17, 9, 8]), r"slices \[17, 9, 8\] must be positive widths "
                                                                 r"summing to y's 35 columns")
    _one_line(lambda: expand(y, s[:, :16], b, scale, slot, [17, 9, 9]), r"s \(7, 16\) torch.float32, "
                                                                        r"expected \(7, 24\)")
    _one_line(lambda: expand(y, s.bfloat16(), b, scale, slot, [17, 9, 9]), "s .* torch.bfloat16")
    _one_line(lambda: expand(y, s, b, scale[:, :2], slot, [17, 9, 9]), r"scale \(3, 2\) torch.float32, "
                                                                       r"expected \(3, 3\)")
    _one_line(lambda: expand(y, s, b[:, :34], scale, slot, [17, 9, 9]), r"y \(7, 35\), b \(3, 34, 8\)")
    _one_line(lambda: expand(y.bfloat16(), s, b, scale, slot, [17, 9, 9]), "y is torch.bfloat16, b is torch.float32")
    meta = [t.to("meta") for t in (x, a, slot)]
    _one_line(lambda: shrink(meta[0][:, :44], meta[1], meta[2]), r"x \(7, 44\)")        # the fake
    with pytest.raises(ValueError, match="COMPILED_LORA_BACKEND"):
        backend("cuda")


def test_fake_shapes_and_fx_trace():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    x, a, b, scale, slot, y = problem(7, 45, [17, 9, 9], 8, 3, torch.bfloat16, 5, SLOTS_7)
    with FakeTensorMode() as mode:
        fx, fa, fb, fsc, fsl, fy = (mode.from_tensor(t) for t in (x, a, b, scale, slot, y))
        s = torch.ops.compiled.lora_shrink(fx, fa, fsl)
        out = torch.ops.compiled.lora_expand(fy, s, fb, fsc, fsl, [17, 9, 9])
    assert s.shape == (7, 24) and s.dtype == torch.float32
    assert out.shape == (7, 35) and out.dtype == torch.bfloat16

    def fn(x, a, b, scale, slot, y):
        return torch.ops.compiled.lora_expand(y, torch.ops.compiled.lora_shrink(x, a, slot), b, scale, slot,
                                              [17, 9, 9])
    gm = make_fx(fn, tracing_mode="fake")(x, a, b, scale, slot, y)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == ["compiled.lora_shrink.default", "compiled.lora_expand.default"]


def test_inductor_compiles_the_ops_as_opaque_calls(backend):
    backend("auto")
    x, a, b, scale, slot, y = problem(7, 45, [17, 9, 9], 8, 3, torch.float32, 6, SLOTS_7)

    def fn(x, a, b, scale, slot, y):
        s = torch.ops.compiled.lora_shrink(x, a, slot)
        return torch.ops.compiled.lora_expand(y * 2, s, b, scale, slot, [17, 9, 9]) + 1
    compiled_fn = torch.compile(fn, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled_fn(x, a, b, scale, slot, y), fn(x, a, b, scale, slot, y))


@pytest.mark.parametrize("T,NR,K", [(1, 48, 2048), (1, 16, 4096), (2, 32, 2048), (8, 32, 2048), (64, 48, 2048),
                                    (256, 48, 2048), (2, 48, 200)])
def test_shrink_heuristic_splits_decode_within_the_workspace(T, NR, K):
    """One row takes the GEMV mode, all of a decode linear's K in one step. Decode above it (up to
    SPLIT_MAX_T tokens) splits K so that at least ~SPLIT_PROGRAMS / 2 programs stream a slot's
    weights, each split at least MIN_K_PER_SPLIT long; larger batches do not split."""
    from compiled.linear import lora_kernels as lk
    cfg = lk.shrink_config(T, NR, K)
    lk._check_config(cfg)
    if T <= lk.GEMV_MAX_T:
        assert cfg.gemv and cfg.split_k == 1 and cfg.block_k >= K
        return
    blocks = -(-T // cfg.block_t) * -(-NR // cfg.block_n)
    assert cfg.split_k * T * NR <= lk.WORKSPACE_FLOATS
    if T > lk.SPLIT_MAX_T or K < 2 * lk.MIN_K_PER_SPLIT:
        assert cfg.split_k == 1
    else:
        assert K // cfg.split_k >= lk.MIN_K_PER_SPLIT and blocks * cfg.split_k <= lk.SPLIT_PROGRAMS
        assert cfg.split_k == lk.MAX_SPLIT_K or blocks * cfg.split_k * 2 > lk.SPLIT_PROGRAMS \
            or K // (2 * cfg.split_k) < lk.MIN_K_PER_SPLIT


# ----------------------------------------------------------------------------------------------
# GPU: real sizes, bf16, R = 16, S = 8

# (name, in, slices): Qwen3-30B-A3B's qkv and o_proj; a dense MLP's gate/up and down at 6144
GPU_SHAPES = [("qkv", 2048, [4096, 512, 512]), ("o", 4096, [2048]), ("gate_up", 2048, [6144, 6144]),
              ("down", 6144, [2048])]


def _gpu_problem(T, IN, slices, seed):
    R, S = 16, 8
    g = torch.Generator(device="cuda").manual_seed(seed)
    N, OUT = len(slices), sum(slices)
    kw = dict(device="cuda", generator=g)
    x = torch.randn(T, IN, **kw).bfloat16()
    a = (torch.randn(S, N * R, IN, **kw) / IN ** 0.5).bfloat16()
    b = (torch.randn(S, OUT, R, **kw) / R ** 0.5).bfloat16()
    scale = torch.rand(S, N, **kw) + 0.5
    slot = torch.randint(-1, S, (T,), **kw, dtype=torch.int32)
    y = torch.randn(T, OUT, **kw).bfloat16()
    return x, a, b, scale, slot, y


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 512])
@pytest.mark.parametrize("name,IN,slices", GPU_SHAPES)
def test_gpu_real_sizes_no_host_sync_and_cuda_graph(backend, T, name, IN, slices):
    backend("auto")
    x, a, b, scale, slot, y = _gpu_problem(T, IN, slices, seed=T)

    def run():
        s = torch.ops.compiled.lora_shrink(x, a, slot)
        return s, torch.ops.compiled.lora_expand(y, s, b, scale, slot, slices)

    def check(s, out):
        s_ref = lora_shrink_ref(x, a, slot)
        assert max_err(s, s_ref) <= 1e-2
        out_ref = lora_expand_ref(y, s_ref, b, scale, slot, slices)
        assert max_err(out, out_ref) <= 1e-2
        assert max_err(out.float() - y.float(), out_ref.float() - y.float()) <= 3e-2   # the delta itself
        none = slot < 0
        assert torch.equal(out[none], y[none]) and not s[none].any()

    check(*run())                                      # compiles outside the checks
    graph, (s, out) = capture_without_host_sync(run)
    for seed in range(2):
        fresh = _gpu_problem(T, IN, slices, seed=1000 + 10 * T + seed)
        for dst, src in zip((x, a, b, scale, slot, y), fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check(s, out)


if __name__ == "__main__":   # run by the fixture above under TRITON_INTERPRET=1
    results = {c[0]: kernel_case(*c[1:]) for c in CASES}
    results.update({c[0]: fused_case(*c[1:]) for c in FUSED_CASES})
    results["op_forced_triton"] = op_case()
    print(json.dumps(results))
