"""A base and a LoRA file of `bench/lora_bench.py` side by side: decode step p50 and prefill
median per engine, and each as a share of the base engine's throughput.

    python bench/lora_compare.py base.json lora.json
"""

from __future__ import annotations

import json
import statistics
import sys


def main(base_path: str, lora_path: str) -> None:
    base = json.load(open(base_path))["base"]
    run = json.load(open(lora_path))
    rows = [("base", base), ("LoRA enabled, idle", run.get("idle")),
            (f"{run['adapters']['num_loras']} adapters", run["lora"])]
    rows = [(name, r) for name, r in rows if r]
    print("| engine | " + " | ".join(f"decode b{b} (ms)" for b in base["decode"]) + " | prefill (ms) | kernels/step |")
    print("|---|" + "---:|" * (len(base["decode"]) + 2))
    for name, r in rows:
        cells = []
        for b, res in r["decode"].items():
            ms, ref = res["decode_step_ms"]["p50"], base["decode"][b]["decode_step_ms"]["p50"]
            cells.append(f"{ms:.3f} ({ref / ms:.1%})")
        pre, ref = statistics.median(r["prefill_ms"]), statistics.median(base["prefill_ms"])
        print(f"| {name} | " + " | ".join(cells) + f" | {pre:.2f} ({ref / pre:.1%}) | {r['kernels_per_step']} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
