"""Host microseconds per call (median of 200, launches only, no sync) of what a prefill runs
eagerly between its piece graphs: the attention's two Triton kernels (norm/RoPE/store, extend)
and the LM head (through the custom op, its body, the kernel's wrapper), beside a trivial
Triton kernel, at a 2,048-token prefill of the Qwen3-30B-A3B shape; then a cProfile of the LM
head's calls. `python bench/host_launch_bench.py` on a CUDA machine."""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
import triton
import triton.language as tl

from compiled.attention.reference import NormRope
from compiled.attention.triton_extend import extend_attention_triton
from compiled.attention.triton_norm_rope import norm_rope_store_triton
from compiled.linear.ops import dispatch
from compiled.linear.skinny_kernels import skinny_linear_triton


@triton.jit
def _tiny(x, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)


def host_us(fn, reps=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    times.sort()
    return 1e6 * times[len(times) // 2]


def main():
    dev = torch.device("cuda")
    T, hq, hkv, d, slots = 2048, 32, 4, 128, 8192
    g = torch.Generator(device=dev).manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g, **bf)
    q, k, v = (t.view(T, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    kc, vc = torch.zeros(slots, hkv, d, **bf), torch.zeros(slots, hkv, d, **bf)
    loc = torch.arange(T, device=dev)
    pos = torch.arange(T, device=dev)
    cos_sin = torch.randn(4096, d, generator=g, **bf)
    rope = NormRope(torch.ones(d, **bf), torch.ones(d, **bf), pos, cos_sin, 1e-6)
    r2t = torch.arange(slots, device=dev, dtype=torch.int32).view(1, -1)
    one = lambda x: torch.tensor([x], device=dev, dtype=torch.int32)  # noqa: E731
    req, seq, ext, start = one(0), one(T), one(T), one(0)
    out = torch.empty(T, hq, d, **bf)
    x = torch.zeros(16, device=dev)
    head = torch.randn(151936, 2048, generator=g, **bf)
    x1 = torch.randn(1, 2048, generator=g, **bf)
    rows = {
        "tiny triton kernel": lambda: _tiny[(1,)](x, 16, BLOCK=16),
        "LM head torch.ops.compiled.linear": lambda: torch.ops.compiled.linear(x1, head),
        "LM head dispatch()": lambda: dispatch(x1, head),
        "LM head skinny_linear_triton": lambda: skinny_linear_triton(x1, head),
        "norm_rope_store_triton": lambda: norm_rope_store_triton(q, k, v, kc, vc, loc, rope),
        "extend_attention_triton": lambda: extend_attention_triton(q, k, v, kc, vc, r2t, req, seq, ext, start, T,
                                                                   0.088, out=out, max_prefix_len=0),
        "torch.empty x2": lambda: (torch.empty(T, hq, d, **bf), torch.empty(T, hkv, d, **bf)),
    }
    for name, fn in rows.items():
        print(f"{name:28s} {host_us(fn):8.1f} us host per call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        rows["LM head torch.ops.compiled.linear"]()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())


if __name__ == "__main__":
    main()
