"""compiled::linear, add_rms_norm_linear, silu_mul_linear with their LoRA operands: a linear with
its LoRA shrink and expand, against the three ops' references run in turn.

CPU: the shrink with the linear's prologue and the skinny kernel with the prologue and the
expand run under `TRITON_INTERPRET=1` in one subprocess (this file run as a script, printing
JSON; see tests/linear/test_linear_kernel.py);
the ops' CPU bodies and their one-line errors run in-process. GPU (`-m gpu`): the 0.6B and 30B
decode shapes at R = 16, S = 8 in bf16, eagerly, with no host sync, and replayed from a CUDA
graph with fresh inputs."""

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
import compiled.linear.library  # noqa: E402,F401  # registers the ops
from compiled.functional import add_rms_norm_ref, silu_and_mul_ref  # noqa: E402
from compiled.linear.lora import lora_expand_ref, lora_shrink_ref  # noqa: E402
from tests.conftest import assert_same_math, capture_without_host_sync  # noqa: E402
from tests.linear.test_linear_kernel import max_err, run_interpreted  # noqa: E402
from tests.linear.test_lora_ops import SLOTS_7, TOL, problem  # noqa: E402

EPS = 1e-6


def lora_operands(a, b, scale, slot, slices) -> dict:
    return dict(lora_a=a, lora_b=b, lora_scale=scale, lora_slot=slot, lora_slices=slices)


def linear_lora(x, w, a, b, scale, slot, slices):
    """compiled::linear with its LoRA operands."""
    return torch.ops.compiled.linear(x, w, **lora_operands(a, b, scale, slot, slices))


def add_rms_norm_linear_lora(x, delta, nw, eps, w, keep_normed, a, b, scale, slot, slices):
    """compiled::add_rms_norm_linear with its linear's LoRA operands."""
    return torch.ops.compiled.add_rms_norm_linear(x, delta, nw, eps, w, keep_normed,
                                                  **lora_operands(a, b, scale, slot, slices))


def silu_mul_linear_lora(gate_up, w, a, b, scale, slot, slices):
    """compiled::silu_mul_linear with its LoRA operands."""
    return torch.ops.compiled.silu_mul_linear(gate_up, w, **lora_operands(a, b, scale, slot, slices))


def linear_lora_add_rms_norm_linear(x, inp, w_in, a, b, scale, slot, nw, eps, w, keep_normed):
    """compiled::add_rms_norm_linear whose delta is inp's one-slice linear by w_in with LoRA."""
    return torch.ops.compiled.add_rms_norm_linear(x, inp, nw, eps, w, keep_normed, lora_slot=slot, delta_weight=w_in,
                                                  delta_lora_a=a, delta_lora_b=b, delta_lora_scale=scale)


def inputs(kind: str, M: int, K: int, slices, R: int, S: int, dtype, seed: int, slots=None):
    """(args before the LoRA tensors, the linear's input as the shrink reads it, a, b, scale, slot)
    for `kind` in plain / norm / silu, fresh non-zero values."""
    x, a, b, scale, slot, _ = problem(M, K, slices, R, S, dtype, seed, slots)
    g = torch.Generator().manual_seed(seed + 1)
    w = (torch.randn(sum(slices), K, generator=g) / K ** 0.5).to(dtype)
    if kind == "plain":
        return (x, w), x, a, b, scale, slot
    if kind == "norm":
        delta = torch.randn(M, K, generator=g).to(dtype)
        nw = (torch.rand(K, generator=g) + 0.5).to(dtype)
        _, normed = add_rms_norm_ref(x, delta, nw, EPS)
        return (x, delta, nw, EPS, w), normed, a, b, scale, slot
    gate_up = torch.randn(M, 2 * K, generator=g).to(dtype)
    return (gate_up, w), silu_and_mul_ref(gate_up), a, b, scale, slot


def reference(kind, head, x_in, a, b, scale, slot, slices):
    w = head[-1]
    return lora_expand_ref(x_in @ w.T, lora_shrink_ref(x_in, a, slot), b, scale, slot, slices)


# (name, kind, M, K, slices, R, S, dtype, slots, skinny config or None for the heuristic's): the
# shrink with the linear's prologue (GEMV mode), then the skinny GEMM with that prologue and the
# expand in its epilogue. GEMV at one row (the heuristic), forced GEMV at several rows, split K,
# tensor-core tiles crossing slices, rank 5, slots out of range, no adapter at all.
PROLOGUE_CASES = [
    ("plain_m1_gemv_bf16", "plain", 1, 45, [17, 9, 9], 8, 3, "bfloat16", [2], None),
    ("plain_m3_gemv_split2_fp32", "plain", 3, 300, [24, 24], 16, 2, "float32", [1, -1, 0], (2, 128, 2, 4, 1, True)),
    ("norm_m1_gemv_bf16", "norm", 1, 72, [40, 8, 8], 8, 3, "bfloat16", [1], None),
    ("norm_m4_gemv_split2_rank5_fp32", "norm", 4, 260, [20], 5, 2, "float32", [0, 1, -1, 0], (2, 64, 2, 4, 1, True)),
    ("norm_m7_tiles_fp32", "norm", 7, 45, [17, 9, 9], 8, 3, "float32", SLOTS_7, (16, 16, 1)),
    ("silu_m1_gemv_bf16", "silu", 1, 96, [33], 8, 3, "bfloat16", [0], None),
    ("silu_m4_out_of_range_fp16", "silu", 4, 40, [24, 8], 8, 3, "float16", [3, -7, 0, 1], (2, 32, 1, 4, 1, True)),
    ("norm_m2_no_adapter_bf16", "norm", 2, 40, [24, 8], 8, 3, "bfloat16", [-1, -1], (2, 32, 1, 4, 1, True)),
]


def prologue_case(kind, M, K, slices, R, S, dtype, slots, config) -> dict:
    """The prologue shrink (against the reference shrink of the prologue's output, rows with an
    adapter) and the skinny GEMM adding its deltas (against the references in turn)."""
    from compiled.linear import lora_kernels as lk, skinny_kernels as sk
    dt = getattr(torch, dtype)
    head, x_in, a, b, scale, slot = inputs(kind, M, K, slices, R, S, dt, seed=M + K + R, slots=slots)
    cfg = None if config is None else sk.SkinnyConfig(*config)
    if kind == "plain":
        s = lk.lora_shrink_triton(head[0], a, slot)
    elif kind == "norm":
        s = lk.shrink_after_norm_triton(*head[:4], a, slot)
    else:
        s = lk.shrink_after_silu_triton(head[0], a, slot)
    la = lk.LoRAArgs.of(s, b, scale, slot, slices)
    errs = []
    if kind == "plain":
        got = sk.skinny_linear_lora_triton(*head, la, cfg)
    elif kind == "norm":
        got, h, _ = sk.add_rms_norm_linear_triton(*head, False, cfg, lora=la)
        errs.append(max_err(h, head[0] + head[1]))   # the interpreter truncates where the GPU rounds
    else:
        got = sk.silu_mul_linear_triton(*head, cfg, lora=la)
    errs.append(max_err(got, reference(kind, head, x_in, a, b, scale, slot, slices)))
    has = (slot >= 0) & (slot < S)
    if has.any():
        errs.append(max_err(s[has], lora_shrink_ref(x_in, a, slot)[has]))
    clean = got.dtype == dt and bool((s[~has] == 0).all())
    return dict(err=max(errs), tol=TOL[dt], clean=clean)


def ops_forced_triton_case() -> dict:
    """The three ops with both backends forced to Triton on CPU: one row (the prologue shrink and
    the epilogue) and seven (the ops' bodies), against the references."""
    from compiled.linear import ops
    lora.set_backend("triton")
    ops.set_backend("triton")
    errs = []
    for M in (1, 7):
        for kind, op in (("plain", linear_lora),
                         ("norm", add_rms_norm_linear_lora),
                         ("silu", silu_mul_linear_lora)):
            head, x_in, a, b, scale, slot = inputs(kind, M, 64, [16, 16], 8, 3, torch.float32, seed=M)
            want = reference(kind, head, x_in, a, b, scale, slot, [16, 16])
            extra = (False,) if kind == "norm" else ()
            out = op(*head, *extra, a, b, scale, slot, [16, 16])
            errs.append(max_err(out[0] if kind == "norm" else out, want))
    return dict(err=max(errs), tol=TOL[torch.float32], clean=True)


# (name, T, K, R, S, dtype, slots): the norm's launch adding a one-slice linear's LoRA deltas to
# its delta input: a ragged K, rank 5 (ranks read 4 at a time), slots out of range, no adapter.
NORM_DELTA_CASES = [
    ("norm_delta_k44_rank5_bf16", 5, 44, 5, 3, "bfloat16", [2, -1, 0, 5, 1]),
    ("norm_delta_k96_rank16_fp32", 4, 96, 16, 2, "float32", [1, 0, -3, 1]),
    ("norm_delta_no_adapter_bf16", 3, 40, 8, 2, "bfloat16", [-1, -1, -1]),
]


def lora_norm_inputs(T, K, R, S, dtype, seed, slots):
    """(x, the linear's base output y, s, b, scale, slot, norm weight) for a one-slice linear of K outputs."""
    _, _, b, scale, slot, y = problem(T, 8, [K], R, S, dtype, seed, slots)
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(T, K, generator=g).to(dtype)
    s = torch.randn(T, R, generator=g)
    nw = (torch.rand(K, generator=g) + 0.5).to(dtype)
    return x, y, s, b, scale, slot, nw


def norm_delta_case(T, K, R, S, dtype, slots) -> dict:
    """`add_rms_norm_triton` with a LoRA delta against the expand's reference and then the norm's."""
    from compiled.linear import lora_kernels as lk, prologue_kernels as pk
    dt = getattr(torch, dtype)
    x, y, s, b, scale, slot, nw = lora_norm_inputs(T, K, R, S, dt, T + K + R, slots)
    h, normed = pk.add_rms_norm_triton(x, y, nw, EPS, lora=lk.LoRAArgs.of(s, b, scale, slot, [K]))
    want_h, want_normed = add_rms_norm_ref(x, lora_expand_ref(y, s, b, scale, slot, [K]), nw, EPS)
    return dict(err=max(max_err(h, want_h), max_err(normed, want_normed)), tol=TOL[dt],
                clean=h.dtype == dt and normed.dtype == dt)


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict]:
    return run_interpreted(__file__)


@pytest.mark.parametrize("name", [c[0] for c in NORM_DELTA_CASES])
def test_interpreted_norm_adds_a_linears_lora_deltas_as_the_expand_would(interpreted_results, name):
    r = interpreted_results[name]
    assert r["err"] <= r["tol"] and r["clean"], r


@pytest.mark.parametrize("name", [c[0] for c in PROLOGUE_CASES] + ["ops_forced_triton"])
def test_interpreted_prologue_shrink_and_epilogue_match_reference(interpreted_results, name):
    r = interpreted_results[name]
    assert r["err"] <= r["tol"] and r["clean"], r


# ----------------------------------------------------------------------------------------------
# The ops on CPU: the references in turn, one-line errors

def _one_line(fn, match):
    with pytest.raises(ValueError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


def test_ops_on_cpu_are_the_references_in_turn():
    head, x_in, a, b, scale, slot = inputs("plain", 7, 45, [17, 9, 9], 8, 3, torch.float32, 6, SLOTS_7)
    out = linear_lora(*head, a, b, scale, slot, [17, 9, 9])
    assert_same_math(out, reference("plain", head, x_in, a, b, scale, slot, [17, 9, 9]))
    head, x_in, a, b, scale, slot = inputs("norm", 7, 45, [17, 9, 9], 8, 3, torch.float32, 7, SLOTS_7)
    y, h, normed = add_rms_norm_linear_lora(*head, True, a, b, scale, slot, [17, 9, 9])
    assert_same_math(y, reference("norm", head, x_in, a, b, scale, slot, [17, 9, 9]))
    assert torch.equal(h, head[0] + head[1])                     # one add: IEEE-rounded everywhere
    assert_same_math(normed, x_in)
    assert add_rms_norm_linear_lora(*head, False, a, b, scale, slot, [17, 9, 9])[2].numel() == 0
    head, x_in, a, b, scale, slot = inputs("silu", 7, 45, [35], 8, 3, torch.float32, 8, SLOTS_7)
    out = silu_mul_linear_lora(*head, a, b, scale, slot, [35])
    assert_same_math(out, reference("silu", head, x_in, a, b, scale, slot, [35]))


def lora_norm_op_inputs(T, IN, K, N, dtype, seed, slots):
    """The arguments of `linear_lora_add_rms_norm_linear`: a linear IN -> K with rank-8 LoRA on 3
    slots, the residual x `[T, K]`, a norm and a linear K -> N after it."""
    (inp, w_in), _, a, b, scale, slot = inputs("plain", T, IN, [K], 8, 3, dtype, seed, slots)
    g = torch.Generator().manual_seed(seed + 3)
    x = torch.randn(T, K, generator=g).to(dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    return x, inp, w_in, a, b, scale, slot, nw, EPS, w


def lora_norm_reference(x, inp, w_in, a, b, scale, slot, nw, eps, w):
    o = lora_expand_ref(inp @ w_in.T, lora_shrink_ref(inp, a, slot), b, scale, slot, [w_in.shape[0]])
    h, normed = add_rms_norm_ref(x, o, nw, eps)
    return normed @ w.T, h, normed


def test_linear_lora_add_rms_norm_linear_on_cpu_is_the_references_in_turn():
    args = lora_norm_op_inputs(7, 45, 36, 11, torch.float32, 9, SLOTS_7)
    y, h, normed = linear_lora_add_rms_norm_linear(*args, True)
    for got, want in zip((y, h, normed), lora_norm_reference(*args)):
        assert_same_math(got, want)
    assert linear_lora_add_rms_norm_linear(*args, False)[2].numel() == 0


def test_expand_in_the_norm_where_the_router_takes_no_prologue(monkeypatch):
    """The norm's launch adds o_proj's deltas past SKINNY_MAX_M rows (up to NORM_LORA_MAX_T), where the
    router's skinny GEMM (a narrow weight, `max_rows`) then runs without the norm; at fewer rows the
    skinny GEMMs take both (the decision alone, with the launches' conditions made true on CPU)."""
    from compiled.linear import NORM_LORA_MAX_T, SKINNY_MAX_M, fused, lora_linear, ops
    monkeypatch.setattr(fused, "own_launch", lambda *tensors: True)
    monkeypatch.setattr(lora, "use_kernel", lambda x: True)
    before = ops.BACKEND.name
    ops.set_backend("triton")
    try:
        w_in, router = torch.randn(2048, 4096), torch.randn(128, 2048)
        for T, expected in ((8, False), (SKINNY_MAX_M + 1, True), (32, True), (NORM_LORA_MAX_T + 1, False)):
            x, inp = torch.randn(T, 2048), torch.randn(T, 4096)
            assert lora_linear._expand_in_norm(x, inp, w_in, router) is expected, T
    finally:
        ops.set_backend(before)


def test_bad_lora_arguments_are_one_line_errors_naming_the_op_and_tensor():
    (x, w), _, a, b, scale, slot = inputs("plain", 7, 45, [17, 9, 9], 8, 3, torch.float32, 6, SLOTS_7)
    op = linear_lora
    _one_line(lambda: op(x, w[:, :44], a, b, scale, slot, [17, 9, 9]), r"compiled::linear: x \(7, 45\) @ weight")
    _one_line(lambda: op(x, w, a[:, :, :44], b, scale, slot, [17, 9, 9]), r"lora_shrink: x \(7, 45\), a \(3, 24, 44\)")
    _one_line(lambda: op(x, w, a[:, :16], b, scale, slot, [17, 9, 9]),
              r"compiled::linear: a \(3, 16, 45\) has 16 rows, expected 3 slices x rank 8")
    _one_line(lambda: op(x, w, a, b, scale, slot, [17, 9, 8]), r"lora_expand: slices \[17, 9, 8\] must be positive")
    _one_line(lambda: op(x, w, a, b, scale[:2], slot, [17, 9, 9]), r"scale \(2, 3\) torch.float32, expected \(3, 3\)")
    _one_line(lambda: op(x, w, a, b, scale, slot[:6], [17, 9, 9]), r"slot \(6,\)")
    head, _, a, b, scale, slot = inputs("norm", 7, 45, [17, 9, 9], 8, 3, torch.float32, 7, SLOTS_7)
    norm = add_rms_norm_linear_lora
    _one_line(lambda: norm(head[0], head[1][:, :44], *head[2:], False, a, b, scale, slot, [17, 9, 9]),
              r"compiled::add_rms_norm_linear: delta \(7, 44\)")
    _one_line(lambda: norm(*head, False, a.double(), b, scale, slot, [17, 9, 9]), "a is torch.float64")
    (gate_up, w), _, a, b, scale, slot = inputs("silu", 7, 45, [35], 8, 3, torch.float32, 8, SLOTS_7)
    silu = silu_mul_linear_lora
    _one_line(lambda: silu(gate_up[:, :88], w, a, b, scale, slot, [35]),
              r"compiled::silu_mul_linear: gate_up \(7, 88\) @ weight \(35, 45\)")
    _one_line(lambda: silu(gate_up, w, a, b[:, :34], scale, slot, [35]), r"lora_expand: y \(7, 35\), b \(3, 34, 8\)")
    x, inp, w_in, a, b, scale, slot, nw, eps, w = lora_norm_op_inputs(7, 45, 36, 11, torch.float32, 9, SLOTS_7)
    op = linear_lora_add_rms_norm_linear
    _one_line(lambda: op(x[:, :35], inp, w_in, a, b, scale, slot, nw, eps, w[:, :35], False),
              r"compiled::add_rms_norm_linear: delta_weight's output \(7, 36\) torch.float32 does not match x")
    _one_line(lambda: op(x, inp, w_in, a, b, scale, slot, nw[:35], eps, w, False),
              r"compiled::add_rms_norm_linear: norm weight \(35,\)")
    _one_line(lambda: op(x, inp, w_in, a, b, scale[:2], slot, nw, eps, w, False), r"scale \(2, 1\)")


# ----------------------------------------------------------------------------------------------
# GPU: real decode shapes, eager and replayed from a CUDA graph

# (kind, in, slices): the 0.6B's qkv, o, gate/up, down; the 30B's o and first qkv
GPU_SHAPES = [("norm", 1024, [2048, 1024, 1024]), ("plain", 2048, [1024]), ("norm", 1024, [3072, 3072]),
              ("silu", 3072, [1024]), ("plain", 4096, [2048]), ("plain", 2048, [4096, 512, 512])]


def _gpu_inputs(kind, T, IN, slices, seed):
    """Slots -1..7 with row 0 always on an adapter (the delta check needs one)."""
    slots = [seed % 8] + [(seed + 3 * i) % 9 - 1 for i in range(1, T)]
    head, x_in, a, b, scale, slot = inputs(kind, T, IN, slices, 16, 8, torch.bfloat16, seed, slots)
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in (*head, x_in, a, b, scale, slot)]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 17])
@pytest.mark.parametrize("kind,IN,slices", GPU_SHAPES)
def test_gpu_ops_match_the_references_eager_and_graph(kind, T, IN, slices):
    """The prologue shrink and the epilogue at one row, the shrink and the epilogue (linear_lora) or
    the ops' bodies (the prologue forms) at 8, the ops' bodies at 17:
    against the references, with no host sync and from a CUDA graph over fresh inputs."""
    op = {"plain": linear_lora, "norm": add_rms_norm_linear_lora,
          "silu": silu_mul_linear_lora}[kind]
    live = _gpu_inputs(kind, T, IN, slices, seed=T)
    n = len(live) - 5
    extra = (False,) if kind == "norm" else ()

    def run():
        out = op(*live[:n], *extra, *live[n + 1:], slices)
        return out[0] if kind == "norm" else out

    def check(out):
        head, x_in = live[:n], live[n]
        want = reference(kind, [t.float() if isinstance(t, torch.Tensor) else t for t in head], x_in.float(),
                         live[n + 1].float(), live[n + 2].float(), *live[n + 3:], slices)
        base = x_in.float() @ head[-1].float().T
        assert out.dtype == torch.bfloat16 and out.shape == want.shape
        assert max_err(out, want) <= 1.6e-2
        assert max_err(out.float() - base, want - base) <= 5e-2   # the delta itself

    check(run())
    graph, out = capture_without_host_sync(run)
    for seed in range(2):
        for dst, src in zip(live, _gpu_inputs(kind, T, IN, slices, seed=100 + 10 * T + seed)):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check(out)


def test_o_proj_lora_bench_smoke_run_on_cpu():
    """bench/o_proj_lora_bench.py --device cpu end to end (interpreted, tiny shapes, FP8 o_proj):
    a line a token count, base and LoRA timed."""
    import subprocess
    from tests.conftest import child_env
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "o_proj_lora_bench.py"), "--device", "cpu",
                           "--tokens", "3", "40", "--hidden", "160", "--inp", "256", "--experts", "8", "--layers", "2",
                           "--reps", "1", "--quantization", "fp8"],
                          env=child_env(TRITON_INTERPRET="1"), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "tokens: base" in line]
    assert [int(line.split()[0]) for line in lines] == [3, 40] and all("LoRA (8 slots)" in line for line in lines)


def fp8_o_proj(g: torch.Generator, N: int, K: int) -> dict:
    """A random FP8 weight `[N, K]` with 128 x 128 block scales around 1/sqrt(K), as operands."""
    q = torch.randn(N, K, generator=g).to(torch.float8_e4m3fn)
    s = (0.5 + torch.rand(-(-N // 128), -(-K // 128), generator=g)) * K ** -0.5
    return dict(delta_weight=q, delta_weight_scale=s, weight_block=[128, 128])


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["none", "fp8"])
@pytest.mark.parametrize("T", [8, 17, 40, 64])
def test_gpu_linear_lora_add_rms_norm_linear_matches_the_references_eager_and_graph(T, quantization):
    """The 30B's o_proj (4,096 -> 2,048) before the post-attention norm and the router (128): the
    two ops in turn at 8 rows (the skinny GEMMs), the expand in the norm's launch at 17-64, against
    the references, with no host sync and from a CUDA graph over fresh inputs. FP8 o_proj: the
    reference's weight dequantized, and its rows quantized as the W8A8 kernel's are where that
    kernel runs (past 32 rows on Hopper)."""
    from compiled.linear import fp8 as fp8_linear
    from compiled.linear.fp8_kernels import a8_group
    from compiled.quant.act_quant import dequantize_per_token_group, quantize_per_token_group_ref
    from compiled.quant.dequant import WeightScale, dequantize_blocks

    def fresh(seed):
        slots = [seed % 8] + [(seed + 3 * i) % 9 - 1 for i in range(1, T)]
        (inp, w_in), _, a, b, scale, slot = inputs("plain", T, 4096, [2048], 16, 8, torch.bfloat16, seed, slots)
        g = torch.Generator().manual_seed(seed + 3)
        x, nw = torch.randn(T, 2048, generator=g), torch.rand(2048, generator=g) + 0.5
        w = torch.randn(128, 2048, generator=g) / 2048 ** 0.5
        fp8 = fp8_o_proj(g, 2048, 4096)
        w_in = fp8.pop("delta_weight") if quantization == "fp8" else w_in

        def on_gpu(t):   # bf16 but the scales, the slots and an FP8 weight
            keep = t is scale or not t.is_floating_point() or t.dtype == torch.float8_e4m3fn
            return t.cuda() if keep else t.to(torch.bfloat16).cuda()
        return ([on_gpu(t) for t in (x, inp, w_in, a, b, scale, slot, nw)] + [EPS, on_gpu(w)],
                {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in fp8.items()})

    live, fp8 = fresh(T)
    extra = fp8 if quantization == "fp8" else {}
    ws = WeightScale(extra["delta_weight_scale"], extra["weight_block"]) if extra else None
    kernel = fp8_linear.kernel_for(live[1], live[2], ws)
    w8a8 = kernel == "w8a8" or (kernel == "w8a16" and a8_group(live[1], live[2], ws.block) > 0)

    def op():
        x, inp, w_in, a, b, scale, slot, nw, eps, w = live
        return torch.ops.compiled.add_rms_norm_linear(x, inp, nw, eps, w, True, lora_slot=slot, delta_weight=w_in,
                                                      delta_lora_a=a, delta_lora_b=b, delta_lora_scale=scale, **extra)

    def check(out):
        x, inp, w_in, a, b, scale, slot, nw, _, w = [t.float() if isinstance(t, torch.Tensor) and t.is_floating_point()
                                                     else t for t in live]
        if ws is not None:
            w_in = dequantize_blocks(live[2], ws.scale, ws.block, torch.float32)
        # the W8A8 kernel's base product reads the rows quantized per token in groups of 128
        base_in = inp
        if w8a8:
            base_in = dequantize_per_token_group(*quantize_per_token_group_ref(inp, 128), 128, torch.float32)
        o = lora_expand_ref(base_in @ w_in.T, lora_shrink_ref(inp, a, slot), b, scale, slot, [2048])
        h, normed = add_rms_norm_ref(x, o, nw, EPS)
        for got, want in zip(out, (normed @ w.T, h, normed)):
            assert got.dtype == torch.bfloat16 and max_err(got, want) <= 3e-2

    check(op())
    graph, out = capture_without_host_sync(op)
    for seed in range(2):
        for dst, src in zip(live, fresh(100 + T + seed)[0]):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check(out)


if __name__ == "__main__":   # run by the fixture above under TRITON_INTERPRET=1
    results = {c[0]: prologue_case(*c[1:]) for c in PROLOGUE_CASES}
    results["ops_forced_triton"] = ops_forced_triton_case()
    results.update({c[0]: norm_delta_case(*c[1:]) for c in NORM_DELTA_CASES})
    print(json.dumps(results))
