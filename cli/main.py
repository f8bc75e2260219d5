"""`compiled` CLI entry point: `run`, `serve`, `graph`, `export` and `bench`."""

from __future__ import annotations

import typer

from cli.bench import bench_app
from cli.errors import OneLineUsageErrors
from cli.export import export
from cli.graph import graph
from cli.run import run
from cli.serve import serve

app = typer.Typer(cls=OneLineUsageErrors, add_completion=False, no_args_is_help=True,
                  help="compiled: a compiled-graph inference runtime for Qwen3 / Qwen3-MoE.")


@app.callback()
def _root() -> None:
    """Keeps every command a subcommand (`compiled run`, not `compiled`)."""


app.command(help="Offline generation; with no MODEL it runs the shipped demo MoE model.")(run)
app.command(help="OpenAI-compatible HTTP server; with no MODEL it serves the shipped demo MoE model.")(serve)
app.command(help="Trace a model, run the graph passes and show what each changed.")(graph)
app.command(help="Compile every piece once and write a loadable artifact.")(export)
app.add_typer(bench_app, name="bench", help="Benchmarks: latency, throughput, serving, startup.")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
