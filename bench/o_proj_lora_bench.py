"""The Qwen3-30B-A3B o_proj (4,096 -> 2,048) with the post-attention residual add + RMSNorm and the
router (2,048 -> 128) after it: one `compiled::add_rms_norm_linear` call with `delta_weight`, as a
decode layer makes it, with S rank-R adapters on the o_proj (each row's slot drawn from all S)
against the same call without them, in CUDA graphs; `--quantization fp8`: a dummy FP8 o_proj
(128 x 128 block scales), the adapters and the router bf16.

    python bench/o_proj_lora_bench.py [--tokens 8 40 64] [--quantization fp8] [--profile]

Prints µs a layer (the median of `--reps` replays of a graph of `--layers` calls, weights cycled
past L2) for the base and the LoRA call; `--profile` adds each one's kernels. `--device cpu`
(under TRITON_INTERPRET=1, tiny shapes from `--hidden`, `--inp`, `--experts`) is a smoke run."""

from __future__ import annotations

import argparse

import torch
import tune_moe   # bench/ is the script's folder, so on sys.path
from expert_lora_bench import print_kernels

import compiled.linear.library  # noqa: F401  (registers the linear ops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="*", default=[8, 40, 64])
    ap.add_argument("--num-slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8, help="weight copies cycled (past L2)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="also print each side's kernels")
    ap.add_argument("--quantization", choices=("none", "fp8"), default="none")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inp", type=int, default=4096, help="o_proj's input width (heads x head_dim)")
    ap.add_argument("--experts", type=int, default=128, help="the router's outputs")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = ap.parse_args()
    tune_moe.DEVICE = a.device
    S, R, H, K, dev = a.num_slots, a.rank, a.hidden, a.inp, torch.device(a.device)
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, fan_in):
        return (torch.randn(*shape, device=dev, generator=g) / fan_in ** 0.5).bfloat16()

    def o_proj() -> dict:
        if a.quantization == "none":
            return dict(delta_weight=rand(H, K, fan_in=K))
        q, s = tune_moe.dummy_fp8(g, (), H, K)
        return dict(delta_weight=q, delta_weight_scale=s, weight_block=list(tune_moe.FP8_BLOCK))

    layers = [(o_proj(), dict(delta_lora_a=rand(S, R, K, fan_in=K), delta_lora_b=rand(S, H, R, fan_in=R),
                              delta_lora_scale=torch.rand(S, 1, device=dev) + 0.5)) for _ in range(a.layers)]
    router, nw = rand(a.experts, H, fan_in=H), (torch.rand(H, device=dev, generator=g) + 0.5).bfloat16()
    for T in a.tokens:
        x, inp = rand(T, H, fan_in=1), rand(T, K, fan_in=1)
        slot = torch.randint(0, S, (T,), device=dev, generator=g, dtype=torch.int32)

        def call(i: int, lora: bool):
            weight, adapters = layers[i]
            extra = dict(adapters, lora_slot=slot) if lora else {}
            return torch.ops.compiled.add_rms_norm_linear(x, inp, nw, 1e-6, router, True, **weight, **extra)

        sides = {"base": [lambda i=i: call(i, False) for i in range(a.layers)],
                 "LoRA": [lambda i=i: call(i, True) for i in range(a.layers)]}
        base, lora = (tune_moe.time_graph(calls, a.reps) / a.layers for calls in sides.values())
        print(f"{T:5d} tokens: base {base:8.1f} µs, LoRA ({S} slots) {lora:8.1f} µs (+{lora - base:.1f})", flush=True)
        if a.profile and a.device == "cuda":
            for name, calls in sides.items():
                print_kernels(f"  {name}", calls, a.reps)


if __name__ == "__main__":
    main()
