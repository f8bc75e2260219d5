"""compiled::linear_add_norm_route (o_proj + residual add + RMSNorm + router + top-k routing in one
kernel) against its torch reference; the op's other path, errors.

CPU: the kernel runs under `TRITON_INTERPRET=1` in one subprocess that runs this file as a script.
GPU (`-m gpu`): the Qwen3-30B-A3B shape in bf16 against the three ops it replaces, eagerly and
replayed from a CUDA graph. The pass that routes the graph here is tested in tests/test_passes.py."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from compiled.moe import linear_route as lr  # noqa: E402
from tests.test_linear_kernel import TOL, max_err, run_interpreted  # noqa: E402

# (name, M, K (attention width), N (hidden), E, top_k, dtype, forced (block_n, block_k, split_k) or None, renormalize)
CASES = [
    ("m1_k64_n48_e8_split2", 1, 64, 48, 8, 2, "float32", (16, 32, 2), True),
    ("m3_k96_n80_e12_split3_ragged", 3, 96, 80, 12, 3, "float32", (32, 32, 3), False),
    ("m16_k64_n64_e128_k8_heuristic", 16, 64, 64, 128, 8, "float32", None, True),
    ("m5_k64_n48_e60_bf16", 5, 64, 48, 60, 6, "bfloat16", (16, 32, 2), True),
    ("m2_k40_n33_e16_no_split", 2, 40, 33, 16, 4, "float32", (16, 16, 1), True),
]


def _inputs(M, K, N, E, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    attn = torch.randn(M, K, generator=g)
    w_o = torch.randn(N, K, generator=g) / K ** 0.5
    x = torch.randn(M, N, generator=g) * torch.linspace(0.3, 4.0, M)[:, None]   # a 1 / rms per row
    nw = 1 + 0.1 * torch.randn(N, generator=g)
    w_router = 2 * torch.randn(E, N, generator=g) / N ** 0.5   # logits of order 1: no expert dominates
    return [t.to(dtype) for t in (attn, w_o, x, nw, w_router)]


def _routing_errors(weights, ids, ref_weights, ref_probs, top_k) -> float:
    """How far the kernel's routing is from the reference's, up to ties: its experts must hold the
    reference's top-k probabilities (in order), distinct, with the reference's weights."""
    chosen = ref_probs.gather(1, ids)
    top = torch.topk(ref_probs, top_k, dim=-1).values
    distinct = bool((ids.sort(-1).values.diff(dim=-1) > 0).all()) if top_k > 1 else True
    return max(max_err(chosen, top), max_err(weights, ref_weights), 0.0 if distinct else float("inf"))


def route_case(M, K, N, E, top_k, dtype, config, renormalize) -> dict:
    """Two calls on fresh inputs (the second proves the counters were put back): h, normed and the
    routing against the fp32 reference; semaphores all zero afterwards."""
    from compiled.graphs import linear_kernels as lk
    dt = getattr(torch, dtype)
    cfg = None if config is None else lk.SkinnyConfig(*config)
    errs = []
    for call in range(2):
        args = _inputs(M, K, N, E, dt, 10 * call)
        h, normed, weights, ids = lr.linear_add_norm_route_triton(*args[:4], 1e-6, args[4], top_k, renormalize, cfg)
        exact = [t.float() for t in args]
        ref_h, ref_normed, ref_weights, _ = lr.linear_add_norm_route_ref(*exact[:4], 1e-6, exact[4], top_k,
                                                                          renormalize)
        errs += [max_err(h, ref_h), max_err(normed, ref_normed)]
        if dt == torch.float32:   # bf16 rounds the logits, so its experts may differ near ties
            probs = torch.softmax(torch.nn.functional.linear(ref_normed, exact[4]), dim=-1)
            errs.append(_routing_errors(weights, ids, ref_weights, probs, top_k))
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (M, top_k)
    clean = not lk._WORKSPACES[torch.device("cpu")].semaphores.any().item()
    return dict(err=max(errs), tol=TOL[dt], clean=clean)


def op_case() -> dict:
    """The op takes the kernel where the linear and routing backends are Triton."""
    import compiled.graphs.linear as lin
    lin.set_backend("triton")
    os.environ["COMPILED_ROUTING_BACKEND"] = "triton"
    args = _inputs(4, 64, 48, 8, torch.float32, 3)
    assert lr.use_fused_kernel(args[0], args[1], args[2], args[4])
    got = torch.ops.compiled.linear_add_norm_route(*args[:4], 1e-6, args[4], 2, True)
    ref = lr.linear_add_norm_route_ref(*args[:4], 1e-6, args[4], 2, True)
    return dict(err=max(max_err(a, b) for a, b in zip(got[:3], ref[:3])), tol=TOL[torch.float32],
                clean=torch.equal(got[3], ref[3]))


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict]:
    return run_interpreted(__file__)


@pytest.mark.parametrize("name", [c[0] for c in CASES] + ["op_forced_triton"])
def test_interpreted_kernel_matches_reference(interpreted_results, name):
    r = interpreted_results[name]
    assert r["err"] <= r["tol"] and r["clean"], r


def test_cpu_op_is_the_three_references():
    args = _inputs(5, 64, 48, 8, torch.float32, 1)
    got = torch.ops.compiled.linear_add_norm_route(*args[:4], 1e-6, args[4], 3, False)
    ref = lr.linear_add_norm_route_ref(*args[:4], 1e-6, args[4], 3, False)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert not lr.use_fused_kernel(args[0], args[1], args[2], args[4])   # CPU, default backends


def test_bad_inputs_are_one_line_errors():
    attn, w_o, x, nw, w_router = _inputs(3, 64, 48, 8, torch.float32, 2)
    op = torch.ops.compiled.linear_add_norm_route
    with pytest.raises(ValueError, match=r"linear_add_norm_route: attn \(3, 63\) @ w_o \(48, 64\)\.T"):
        op(attn[:, :63], w_o, x, nw, 1e-6, w_router, 2, True)
    with pytest.raises(ValueError, match=r"linear_add_norm_route: x \(3, 47\), expected \(3, 48\)"):
        op(attn, w_o, x[:, :47], nw, 1e-6, w_router, 2, True)
    with pytest.raises(ValueError, match=r"linear_add_norm_route: w_router \(8, 47\), expected \(8, 48\)"):
        op(attn, w_o, x, nw, 1e-6, w_router[:, :47], 2, True)
    with pytest.raises(ValueError, match=r"linear_add_norm_route: norm weight \(47,\), expected \(48,\)"):
        op(attn, w_o, x, nw[:47], 1e-6, w_router, 2, True)
    with pytest.raises(ValueError, match=r"linear_add_norm_route: top_k=9 for 8 experts"):
        op(attn, w_o, x, nw, 1e-6, w_router, 9, True)
    with pytest.raises(ValueError, match=r"linear_add_norm_route: w_o is torch.float32, attn is torch.bfloat16"):
        op(attn.bfloat16(), w_o, x, nw, 1e-6, w_router, 2, True)


# ----------------------------------------------------------------------------------------------
# GPU: the Qwen3-30B-A3B layer's shapes

@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 8, 16])
def test_gpu_matches_the_three_ops_eager_and_graphed(M):
    # h is bit for bit the three ops' (the same projection tiles and split order); normed and the
    # routing weights differ only by the order of fp32 sums; the experts are the same up to ties
    dev = torch.device("cuda")
    args = [t.to(dev) for t in _inputs(M, 4096, 2048, 128, torch.bfloat16, 100 + M)]
    attn, w_o, x, nw, w_router = args

    def fused():
        return torch.ops.compiled.linear_add_norm_route(attn, w_o, x, nw, 1e-6, w_router, 8, True)

    def apart():
        y = torch.ops.compiled.linear(attn, w_o)
        logits, h, normed = torch.ops.compiled.add_rms_norm_linear(x, y, nw, 1e-6, w_router, True)
        return (h, normed, *torch.ops.compiled.topk_route(logits, 8, True)), logits

    def check(got, want):
        (h, normed, weights, ids), logits = want
        assert torch.equal(got[0], h)
        torch.testing.assert_close(got[1].float(), normed.float(), atol=0, rtol=2 ** -7)
        probs = torch.softmax(logits.float(), dim=-1)
        assert _routing_errors(got[2], got[3], weights, probs, 8) <= 2e-3
    assert lr.use_fused_kernel(attn, w_o, x, w_router)
    check(fused(), apart())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fused()
    for t, new in zip(args, _inputs(M, 4096, 2048, 128, torch.bfloat16, 200 + M)):
        t.copy_(new)
    graph.replay()
    check(outs, apart())


if __name__ == "__main__":   # run by the fixture above under TRITON_INTERPRET=1
    results = {c[0]: route_case(*c[1:]) for c in CASES}
    results["op_forced_triton"] = op_case()
    print(json.dumps(results))
