"""One-line errors for the CLI: a clear message and a non-zero exit, tracebacks only with --debug.

Two exit codes, as Click and argparse use them: 2 for a command line that does not parse (an
unknown option, a value of the wrong type, a missing argument), 1 for input that parses but is
bad (a missing model folder, an out-of-range setting, a malformed file)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup


def print_error(message: str) -> None:
    Console(stderr=True).print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True)


class OneLineUsageErrors(TyperGroup):
    """The root command group: a usage error is one `error: ...` line with Click's exit code 2,
    where Typer prints the usage line, a hint and the message in a box."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            # Not standalone, Typer re-raises Click's errors instead of printing them, and returns
            # the exit code of a typer.Exit (--help, fail_cleanly, Ctrl-C as 130) instead of exiting.
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as e:  # Click's errors (Typer vendors Click and derives them from it)
            # The name, as Typer itself checks it: the help it stands for is already printed.
            if type(e).__name__ != "NoArgsIsHelpError":
                message = " ".join(e.format_message().split())
                ctx = getattr(e, "ctx", None)
                if ctx is not None:
                    message += f" (see '{ctx.command_path} --help')"
                print_error(message)
            sys.exit(e.exit_code)
        except typer.Abort:
            print_error("aborted")
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)


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
        print_error(message)
        raise typer.Exit(code=1) from None
