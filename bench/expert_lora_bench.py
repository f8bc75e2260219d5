"""One Qwen3-30B-A3B MoE layer with expert LoRA against the base fused MoE, in CUDA graphs:
E = 128, H = 2,048, I = 768, top-8, bf16 (`--quantization fp8`: dummy FP8 experts, the adapters
bf16), S slots of rank R, each token's slot drawn from `--slots` (uniform over all S, or one
adapter for every token: prefill of one request).

    python bench/expert_lora_bench.py [--tokens 1 8 64 2048] [--slots all|one] [--quantization fp8]

Prints µs per layer (the median of `--reps` replays of a graph of `--layers` calls, weights
cycled past L2) for the base MoE and the LoRA MoE; `--profile` adds each one's kernels (µs a layer,
from the torch profiler over the same calls run eagerly)."""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from tune_moe import make_fp8_weights, time_graph   # bench/ is the script's folder, so on sys.path

from compiled.moe import expert_lora as el
from compiled.moe import fused_moe as fm

E, H, I, TOP_K = 128, 2048, 768, 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 64, 2048])
    ap.add_argument("--slots", choices=("all", "one"), default="all")
    ap.add_argument("--num-slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4, help="weight copies cycled (past L2)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="also print each side's kernels")
    ap.add_argument("--quantization", choices=("none", "fp8"), default="none",
                    help="fp8: dummy FP8 experts (128 x 128 block scales), the adapters bf16")
    a = ap.parse_args()
    S, R, dev = a.num_slots, a.rank, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, fan_in):
        return (torch.randn(*shape, device=dev, generator=g) / fan_in ** 0.5).bfloat16()

    if a.quantization == "fp8":
        experts = list(zip(*make_fp8_weights(a.layers, E, H, I)))
    else:
        experts = [(rand(E, 2 * I, H, fan_in=H), rand(E, H, I, fan_in=I), None) for _ in range(a.layers)]
    layers = [(w13, w2, rand(S, E, 2 * R, H, fan_in=H), rand(S, E, 2 * I, R, fan_in=R), rand(S, E, R, I, fan_in=I),
               rand(S, E, H, R, fan_in=R), torch.rand(S, 3, device=dev) + 0.5) for w13, w2, _ in experts]
    scales = [sc for *_, sc in experts]
    for T in a.tokens:
        x = torch.randn(T, H, device=dev, generator=g).bfloat16()
        w, ids = torch.ops.compiled.topk_route(torch.randn(T, E, device=dev, generator=g), TOP_K, True)
        slot = (torch.randint(0, S, (T,), device=dev, generator=g, dtype=torch.int32) if a.slots == "all"
                else torch.zeros(T, dtype=torch.int32, device=dev))
        ws = el.reserve_workspace(fm.MoEWorkspace(), T, E, H, I, TOP_K, R, torch.bfloat16, dev)
        sides = {"base": [lambda i=i: fm.fused_moe_triton(x, w, ids, *layers[i][:2], workspace=ws,
                                                          scales=scales[i]) for i in range(a.layers)],
                 "LoRA": [lambda i=i: el.fused_moe_lora_triton(x, w, ids, *layers[i], slot, workspace=ws,
                                                               scales=scales[i]) for i in range(a.layers)]}
        base, lora = (time_graph(calls, a.reps) / a.layers for calls in sides.values())
        print(f"{T:5d} tokens: base {base:8.1f} µs, LoRA ({a.slots} of {S} slots) {lora:8.1f} µs "
              f"(+{lora - base:.1f})", flush=True)
        if a.profile:
            for name, calls in sides.items():
                print_kernels(f"  {name}", calls, a.reps)


def print_kernels(title: str, calls: list, reps: int) -> None:
    """Each kernel's GPU time a call (µs), from the torch profiler over `reps` passes of `calls`."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for call in calls:
                call()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] += e.device_time / (reps * len(calls))
    print(f"{title}: kernels {sum(per_kernel.values()):.1f} µs: " + ", ".join(
        f"{k} {v:.1f}" for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:10]), flush=True)


if __name__ == "__main__":
    main()
