"""The `compiled` command line (Typer + rich): argument parsing over the Python API in compiled/;
every engine default comes from the engine config."""
