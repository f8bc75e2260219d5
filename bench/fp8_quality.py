"""What FP8's rounding costs a trained model: a demo model loaded as is and quantized at load
(`quantization="fp8"`, 128 x 128 blocks), the same prompts through both, greedy. Prints the share
of generated tokens that agree (up to the first disagreement of each prompt, and in all) and the
largest difference between the two prompt logprobs over the whole vocabulary.

    python bench/fp8_quality.py [--model moe|dense] [--max-new-tokens 24] [--device cpu]
"""

from __future__ import annotations

import argparse

from compiled import LLM, SamplingParams, demo


def _run(model: str, device: str, quantization: str | None, prompts: list[str], max_new: int):
    llm = LLM(model, device=device, dtype="float32", quantization=quantization)
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, prompt_logprobs=-1)
    return llm.generate(prompts, sampling)


def _max_logprob_gap(a, b) -> float:
    gap = 0.0
    for pa, pb in zip(a.prompt_logprobs, b.prompt_logprobs):
        if pa is None or pb is None:   # the first position has none
            continue
        gap = max(gap, max(abs(pa[t] - pb[t]) for t in pa))
    return gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("moe", "dense"), default="moe")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model = demo.MOE_MODEL if args.model == "moe" else demo.DENSE_MODEL
    prompts = demo.EXAMPLE_PROMPTS
    base = _run(model, args.device, None, prompts, args.max_new_tokens)
    fp8 = _run(model, args.device, "fp8", prompts, args.max_new_tokens)
    same = sum(x == y for a, b in zip(base, fp8) for x, y in zip(a.token_ids, b.token_ids))
    prefix = 0
    for a, b in zip(base, fp8):
        prefix += next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
    total = sum(len(a.token_ids) for a in base)
    gap = max(_max_logprob_gap(a, b) for a, b in zip(base, fp8))
    print(f"demo {args.model}, {len(prompts)} prompts x {args.max_new_tokens} greedy tokens, fp32 vs FP8 128x128 "
          f"quantized at load")
    print(f"tokens equal: {same} / {total} ({same / total:.1%}); before each prompt's first difference: {prefix} / "
          f"{total}")
    print(f"largest prompt-logprob difference over the vocabulary: {gap:.3f}")


if __name__ == "__main__":
    main()
