"""One-line errors for the CLI: a clear message and a non-zero exit, tracebacks only with --debug."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import typer
from rich.console import Console


@contextmanager
def fail_cleanly(debug: bool) -> Iterator[None]:
    try:
        yield
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except Exception as e:
        if debug:
            raise
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        Console(stderr=True).print(f"[bold red]error:[/bold red] {message}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1) from None
