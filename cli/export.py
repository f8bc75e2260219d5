"""`compiled export`: compile every piece once and write a loadable artifact."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from cli.errors import fail_cleanly


def export(
    model: str = typer.Argument(..., help="HF model folder."),
    out: Path = typer.Option(..., "--out", help="Folder to write the artifact to."),
    buckets: Optional[str] = typer.Option(None, help="Decode CUDA-graph batch buckets, e.g. 1,2,4,8 (recorded)."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or float16."),
    load_format: str = typer.Option("dummy", help="Weights do not change the compiled code: dummy skips reading them."),
    passes: Optional[str] = typer.Option(None, help="Comma-separated pass list (default: all)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    with fail_cleanly(debug):
        from compiled import LLM
        bucket_list = [int(b) for b in buckets.split(",")] if buckets else None
        pass_list = [p.strip() for p in passes.split(",") if p.strip()] if passes else None
        start = time.perf_counter()
        llm = LLM(model, device=device, dtype=dtype, load_format=load_format, compile=True,
                  cuda_graph_buckets=bucket_list, passes=pass_list,
                  max_num_seqs=max(bucket_list) if bucket_list else 256)
        llm.export_artifact(str(out))
        table = Table(title=f"exported {model} -> {out}")
        table.add_column("stage")
        table.add_column("seconds", justify="right")
        for stage, seconds in llm.startup_seconds.items():
            table.add_row(stage, f"{seconds:.2f}")
        table.add_row("total", f"{time.perf_counter() - start:.2f}")
        Console().print(table)
        report = llm.build_report
        Console().print(f"{report.pieces} pieces, {report.unique_pieces} unique, compiled {report.compiled_now}")
