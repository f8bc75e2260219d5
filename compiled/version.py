"""The package's version: pyproject.toml reads it from here, as do artifacts' manifests and the server."""

__version__ = "0.1.0"
