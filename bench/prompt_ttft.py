"""Time to first token of a lone prompt at several lengths (dummy weights, the engine's defaults).

    PYTHONPATH=$PWD python bench/prompt_ttft.py bench/configs/qwen3-30b-a3b [--quantization fp8]
        [--lengths 64 256 1024 2048] [--reps 9] [--out ttft.json]

One engine; per length, one prompt of random tokens run `--reps` times, alone in the engine
(nothing cached between runs), timed from `add` to its first token on the host with the device
synchronised (median). The first time a length runs it also captures its token bucket's graphs
where the start left them for later, which the median leaves out. To time another checkout's
engine with this script, put that checkout on PYTHONPATH instead (the script imports the engine
from there, not from beside it)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from cli import bench_core as core
from compiled.runtime.config import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 2048])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--quantization", default=None, help="quantize the weights at load (fp8)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    config = EngineConfig(model=a.model, load_format="dummy", max_model_len=a.max_model_len,
                          max_num_seqs=a.max_num_seqs, quantization=a.quantization)
    llm, start = core.startup(config, min(a.lengths))
    vocab = llm.model_config.vocab_size
    record = {"model": a.model, "environment": core.environment(llm.config.device), "quantization": a.quantization,
              "startup_stages_s": start["stages_s"], "ttft_ms": {}}
    for n in a.lengths:
        prompt = core.random_ids(1, n, vocab, n)[0]
        times = [1e3 * core.first_token(llm, prompt) for _ in range(a.reps)]
        record["ttft_ms"][n] = {"median": statistics.median(times), "all": times}
        print(f"{n} tokens: time to first token {statistics.median(times):.3f} ms (median of {a.reps})", flush=True)
    if a.out is not None:
        a.out.write_text(json.dumps(core._clean(record), indent=1))


if __name__ == "__main__":
    main()
