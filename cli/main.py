"""`compiled` CLI entry point: `run` and `graph` (more commands join as their issues land)."""

from __future__ import annotations

import typer

from cli.graph import graph
from cli.run import run

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="compiled: a compiled-graph inference runtime for Qwen3 / Qwen3-MoE.")


@app.callback()
def _root() -> None:
    """Keeps `run` a subcommand even while it is the only one."""


app.command(help="Offline generation; with no MODEL it runs the shipped demo MoE model.")(run)
app.command(help="Trace a model, run the graph passes and show what each changed.")(graph)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
