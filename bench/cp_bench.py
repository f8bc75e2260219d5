"""Context-parallel prefill on one host: time to first token of one prompt per length through the
CP group and on rank 0 alone (the same engine, so the same weights and compiled code), and for
the `--check` lengths the prompt logprobs and greedy tokens of both, compared.

    python bench/cp_bench.py bench/configs/qwen3-30b-a3b --cp 2 \
        --lengths 512,1024,2048,4096,8192,16384,32768 --check 8192,32768 --out cp2.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cli import bench_core as core
from compiled import LLM, SamplingParams


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _prompt(length: int, vocab: int) -> list[int]:
    return core.random_ids(1, length, vocab, seed=length)[0]


def check(llm: LLM, length: int, vocab: int, new_tokens: int) -> dict:
    """Prompt logprobs (the prompt token and the top one) and greedy tokens, CP against rank 0."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    prompt = _prompt(length, vocab)
    steps_before = llm.engine.runner.cp.steps
    split, alone = core.with_and_without_cp(llm, lambda: llm.generate([prompt], params)[0])
    diffs = [abs(a[k] - b[k]) for a, b in zip(split.prompt_logprobs[1:], alone.prompt_logprobs[1:])
             for k in a.keys() & b.keys()]
    return {"length": length, "cp_steps": llm.engine.runner.cp.steps - steps_before,
            "max_abs_logprob_diff": max(diffs), "mean_abs_logprob_diff": sum(diffs) / len(diffs),
            "greedy_equal": split.token_ids == alone.token_ids,
            "greedy_cp": split.token_ids, "greedy_cp1": alone.token_ids}


def profile(llm: LLM, length: int, vocab: int, out_dir: str) -> dict:
    """torch.profiler over the prefill step of one prompt on rank 0, with the group and without:
    top kernels, the GPU's idle gaps and the host's CUDA calls (where rank 0 waits for a rank)."""
    item = [core.Item(_prompt(length, vocab), 1)]

    def one() -> dict:
        name = f"cp{llm.context_parallel if llm.engine.runner.cp else 1}_{length}"
        return core.profile_steps(llm, item, 1, Path(out_dir), name, skip_prefill=False)

    split, alone = core.with_and_without_cp(llm, one)
    return {"length": length, "cp": split, "cp1": alone}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--lengths", type=_ints, default=_ints("1024,2048,4096,8192,16384,32768"))
    ap.add_argument("--check", type=_ints, default=_ints("8192,32768"))
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--profile", metavar="DIR", help="Also profile rank 0's prefill step (Chrome traces here).")
    ap.add_argument("--profile-length", type=int, default=2048)
    ap.add_argument("--out")
    a = ap.parse_args()
    longest = max(a.lengths + a.check + ([a.profile_length] if a.profile else []))
    t0 = time.perf_counter()
    llm = LLM(a.model, load_format=a.load_format, context_parallel_size=a.cp, cp_min_tokens=2 * a.cp,
              max_num_batched_tokens=longest, max_model_len=longest + a.new_tokens + 16,
              kv_cache_tokens=longest + a.new_tokens + 64, max_num_seqs=4)
    res: dict = {"cp": a.cp, "start_s": time.perf_counter() - t0, "ttft": [], "check": []}
    vocab = llm.engine.model_config.vocab_size
    try:
        for length in a.lengths:
            row = core.ttft_beside_cp1(llm, [_prompt(length, vocab)], a.iters)
            cp, alone = row["ttft_ms"]["p50"], row["ttft_cp1_ms"]["p50"]
            res["ttft"].append({"length": length, "ttft_cp_ms": cp, "ttft_cp1_ms": alone, "speedup": alone / cp})
            print(f"len {length:6d}  CP={a.cp} {cp:9.2f} ms  CP=1 {alone:9.2f} ms  speedup {alone / cp:5.2f}x",
                  flush=True)
        for length in a.check:
            row = check(llm, length, vocab, a.new_tokens)
            res["check"].append(row)
            print(f"check {length:6d}  cp steps {row['cp_steps']}  max |dlogprob| {row['max_abs_logprob_diff']:.4f}"
                  f"  mean {row['mean_abs_logprob_diff']:.5f}  greedy equal {row['greedy_equal']}", flush=True)
        if a.profile:
            res["profile"] = profile(llm, a.profile_length, vocab, a.profile)
            for side in ("cp", "cp1"):
                p = res["profile"][side]
                print(f"profile {side}, {p['sort_by']}, total {p['total_self_ms']:.1f} ms:")
                for row in p["top"][:12]:
                    print(f"  {row['self_ms']:8.2f} ms {row['calls']:5d}x  {row['name'][:90]}")
                for row in p.get("runtime_calls") or []:
                    print(f"  host {row['ms']:8.2f} ms {row['calls']:5d}x  {row['name']}")
                for gap in (p.get("idle_gaps") or [])[:5]:
                    print(f"  idle {gap['idle_us'] / 1e3:8.2f} ms before {gap['before']}; host: {gap['host']}")
    finally:
        llm.shutdown()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
