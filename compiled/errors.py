"""Errors the user can act on: each carries a one-line message naming the thing at fault.

The CLI prints these without a traceback; anything else is a bug and keeps its traceback."""


class CompiledError(Exception):
    """Base for every user-facing error of the package."""


class ConfigError(CompiledError, ValueError):
    """A model's config.json is missing, malformed or describes an unsupported model."""


class CheckpointError(CompiledError, ValueError):
    """A safetensors file or tensor is missing, truncated, unexpected or mis-shaped."""


class RequestError(CompiledError, ValueError):
    """A request cannot be served: empty or too-long prompt, unknown adapter, bad parameters."""
