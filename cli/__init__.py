"""The `compiled` command line (Typer + rich).

Thin wrappers over the Python API in compiled/."""
