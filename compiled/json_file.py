"""The JSON files of checkpoints, tokenizers and adapters, read with a one-line error naming the file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from compiled.errors import ConfigError


def read_json_object(file: str | os.PathLike, error: Callable[[str], Exception] = ConfigError) -> dict:
    """The JSON object in `file`; malformed JSON or another JSON value raises `error(message)`."""
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{file}: malformed JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data
