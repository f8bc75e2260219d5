"""`compiled export`: compile every piece once and write a loadable artifact."""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
import typer
from rich.console import Console
from rich.table import Table

from cli.engine_options import DEFAULTS, build_llm, engine_config, engine_option
from cli.errors import fail_cleanly
from compiled.runtime.config import resolve_device


def export(
    model: Optional[str] = typer.Argument(None, help="HF model folder; default: the shipped demo MoE model."),
    out: Path = typer.Option(..., "--out", help="Folder to write the artifact to."),
    buckets: Optional[str] = typer.Option(None, help="Decode CUDA-graph batch buckets, e.g. 1,2,4,8 (recorded)."),
    device: Optional[str] = engine_option("device"),
    dtype: Optional[str] = engine_option("dtype"),
    tensor_parallel_size: int = engine_option("tensor_parallel_size"),
    enable_expert_parallel: bool = engine_option("enable_expert_parallel"),
    load_format: str = typer.Option("dummy", help="Weights do not change the compiled code: dummy (the "
                                    "default here) skips reading them."),
    quantization: Optional[str] = engine_option("quantization", help="fp8: export for the model quantized to block "
                                                "FP8 while loading (runs then pass it too; FP8 checkpoints need "
                                                "nothing)."),
    passes: Optional[str] = typer.Option(None, help="Comma-separated pass list (default: all)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    with fail_cleanly(debug):
        bucket_list = parse_buckets(buckets) if buckets else None
        pass_list = [p.strip() for p in passes.split(",") if p.strip()] if passes else None
        start = time.perf_counter()
        config = engine_config(dict(model=model, device=device, dtype=dtype, load_format=load_format,
                                    quantization=quantization, tensor_parallel_size=tensor_parallel_size,
                                    enable_expert_parallel=enable_expert_parallel), compile=True,
                               cuda_graph_buckets=bucket_list, passes=pass_list,
                               max_num_seqs=max(bucket_list) if bucket_list else DEFAULTS.max_num_seqs)
        with empty_triton_cache(resolve_device(config.device)):
            llm = build_llm(config)
            run_mixed_lengths(llm)
            llm.engine.capture_pending_graphs()   # the kernels of every bucket go into the artifact
            llm.export_artifact(str(out))
        table = Table(title=f"exported {llm.model_path} -> {out}")
        table.add_column("stage")
        table.add_column("seconds", justify="right")
        for stage, seconds in llm.startup_seconds.items():
            table.add_row(stage, f"{seconds:.2f}")
        table.add_row("total", f"{time.perf_counter() - start:.2f}")
        Console().print(table)
        report = llm.build_report
        Console().print(f"{report.pieces} pieces, {report.unique_pieces} unique, compiled {report.compiled_now}")


EXPORT_PROMPT_LENGTHS = (1, 17, 100)


@contextlib.contextmanager
def empty_triton_cache(device: torch.device) -> Iterator[None]:
    """On a GPU, compile into an empty Triton cache folder (removed after), so that the artifact
    holds exactly the kernels the engine launches, those other runs had cached included."""
    if device.type != "cuda":
        yield
        return
    import compiled.envs as envs
    previous = envs.read("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="compiled-export-triton-") as folder:
        envs.set_for_children("TRITON_CACHE_DIR", folder)
        try:
            yield
        finally:
            envs.restore("TRITON_CACHE_DIR", previous)


def run_mixed_lengths(llm) -> None:
    """A few requests of odd and even lengths, prompt and decode: Triton specialises kernels on
    their integer arguments (1, multiples of 16), so these put the variants serving launches, and
    capture may not, into the cache the artifact copies."""
    from compiled.runtime.sampling_params import SamplingParams
    prompts = [[1 + i % 7 for i in range(n)] for n in EXPORT_PROMPT_LENGTHS]
    llm.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))


def parse_buckets(text: str) -> list[int]:
    """`--buckets 1,2,4,8` as ints, each >= 1 (the largest also sets max_num_seqs)."""
    try:
        buckets = [int(b) for b in text.split(",")]
    except ValueError:
        buckets = []
    if not buckets or min(buckets) < 1:
        raise ValueError(f"--buckets {text!r}: expected comma-separated ints >= 1, e.g. 1,2,4,8")
    return buckets
