"""The W8A16 Triton linear against the dequantize-then-linear reference: on CPU under
TRITON_INTERPRET=1 (one subprocess), block scales with partial edges, per channel, per tensor."""

from __future__ import annotations

import json
import os

import pytest
import torch

from compiled.quant.config import QuantConfig
from compiled.quant.dequant import dequantize_blocks, quantize, resolve_block

CASES = [("block16x24_m3", 3, 56, 40, QuantConfig("fp8", "block", (16, 24))),
         ("block128_m1", 1, 72, 200, QuantConfig("fp8", "block", (128, 128))),
         ("channel_m17", 17, 40, 70, QuantConfig("compressed-tensors", "channel")),
         ("tensor_m5", 5, 33, 65, QuantConfig("compressed-tensors", "tensor"))]


def kernel_case(M: int, N: int, K: int, quant: QuantConfig) -> dict:
    import compiled.linear.library  # noqa: F401
    from compiled.linear import ops as lin
    from compiled.linear.fp8_kernels import w8a16_linear
    g = torch.Generator().manual_seed(M * N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    q, s = quantize(w, quant)
    block = list(quant.op_block)
    bo, bi = resolve_block(block, N, K)
    s = s.reshape(-(-N // bo), -(-K // bi))
    ref = torch.nn.functional.linear(x, dequantize_blocks(q, s, block, torch.float32))
    err = (w8a16_linear(x, q, s, block) - ref).abs().max().item()
    lin.set_backend("triton")   # the op's dispatch to the kernel
    err = max(err, (torch.ops.compiled.linear(x, q, weight_scale=s, weight_block=block) - ref).abs().max().item())
    return dict(err=err, tol=1e-4)


@pytest.fixture(scope="module")
def interpreted():
    from tests.linear.test_linear_kernel import run_interpreted
    return run_interpreted(__file__)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_interpreted_w8a16_matches_reference(interpreted, name):
    r = interpreted[name]
    assert r["err"] <= r["tol"], r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 8, 64])
def test_gpu_w8a16_matches_reference_in_bf16(m):
    from compiled.linear.fp8_kernels import w8a16_linear
    quant = QuantConfig("fp8", "block", (128, 128))
    w = torch.randn(2048 + 64, 768, device="cuda")
    q, s = quantize(w, quant)
    x = torch.randn(m, 768, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), dequantize_blocks(q, s, [128, 128], torch.float32))
    assert (w8a16_linear(x, q, s, [128, 128]).float() - ref).abs().max() <= 0.05 * ref.abs().max()


if __name__ == "__main__":   # run by the fixture above under TRITON_INTERPRET=1
    os.environ.setdefault("COMPILED_LINEAR_BACKEND", "auto")
    print(json.dumps({name: kernel_case(M, N, K, quant) for name, M, N, K, quant in CASES}))
