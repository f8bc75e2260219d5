"""The norm kernels with a linear's LoRA work inside against the norm kernel and that work's own
launch, Qwen3-30B-A3B shapes (H = 2,048), bf16, S slots of rank R, tokens on slots round-robin:

    qkv:  the MoE's top-k sum + residual add + RMSNorm, then the qkv's shrink (3 x R outputs)
          against the same kernel running the shrink (`moe_sum_add_rms_norm_triton(shrink=...)`)
    o:    o_proj's expand, then the post-attention add + RMSNorm
          against the norm kernel adding the deltas (`add_rms_norm_triton(lora=...)`)

    python bench/norm_lora_bench.py [--tokens 1 8 64] [--outputs-a-program 1 8]
    TRITON_INTERPRET=1 python bench/norm_lora_bench.py --device cpu --tokens 1 2 --calls 1   # a smoke run

Prints µs a call: the median of `--reps` replays of a CUDA graph of `--calls` calls in a row
(inputs in L2, as in a decode step, where the previous kernel wrote them). `--outputs-a-program`
times the qkv shrink at each of these splits (default: the engine's `shrink_outputs_a_program`)."""

from __future__ import annotations

import argparse

import torch
import tune_moe   # bench/ is the script's folder, so on sys.path

from compiled.linear.lora_kernels import LoRAArgs, lora_expand_triton, lora_shrink_triton
from compiled.linear.prologue_kernels import add_rms_norm_triton
from compiled.moe import fused_moe as fm

H, TOP_K, QKV_SLICES = 2048, 8, 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--num-slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--outputs-a-program", type=int, nargs="*", default=[])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (wall clock)")
    a = ap.parse_args()
    tune_moe.DEVICE = a.device
    S, R, dev = a.num_slots, a.rank, torch.device(a.device)
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).bfloat16()

    a_qkv = rand(S, QKV_SLICES * R, H, scale=H ** -0.5)
    b_o, scale_o = rand(S, H, R, scale=R ** -0.5), torch.rand(S, 1, device=dev) + 0.5
    nw = rand(H).abs() + 0.5

    def per_call(fn) -> float:
        return tune_moe.time_graph([fn] * a.calls, reps=a.reps) / a.calls

    for T in a.tokens:
        pairs, x, y = rand(T * TOP_K, H), rand(T, H), rand(T, H)
        s_o = torch.randn(T, R, device=dev, generator=g)
        slot = torch.arange(T, device=dev, dtype=torch.int32) % S
        la = LoRAArgs.of(s_o, b_o, scale_o, slot, [H])

        def qkv_separate():
            lora_shrink_triton(fm.moe_sum_add_rms_norm_triton(pairs, x, nw, 1e-6)[1], a_qkv, slot)

        def o_separate():
            add_rms_norm_triton(x, lora_expand_triton(y, s_o, b_o, scale_o, slot, [H]), nw, 1e-6)

        row = [f"tokens {T}: qkv separate {per_call(qkv_separate):.2f}"]
        default = fm.shrink_outputs_a_program
        for n in a.outputs_a_program or [default(T)]:
            fm.shrink_outputs_a_program = lambda _T, n=n: n
            try:
                fused = per_call(lambda: fm.moe_sum_add_rms_norm_triton(pairs, x, nw, 1e-6, shrink=(a_qkv, slot)))
            finally:
                fm.shrink_outputs_a_program = default
            row.append(f"in the norm ({n} a program) {fused:.2f}")
        row.append(f"| o separate {per_call(o_separate):.2f}")
        row.append(f"in the norm {per_call(lambda: add_rms_norm_triton(x, y, nw, 1e-6, lora=la)):.2f}")
        print("  ".join(row), flush=True)

if __name__ == "__main__":
    main()
