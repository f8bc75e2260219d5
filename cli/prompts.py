"""Prompts files (JSONL) shared by `compiled run` and `compiled bench`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

Prompt = str | list[int]


def read_jsonl_prompts(path: Path) -> Iterator[tuple[int, Prompt, dict]]:
    """(line number, prompt, the line's object or {}) per non-blank line. A line is a string, a
    list of token ids, or an object with "prompt" (text) or "prompt_token_ids"."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{path}: cannot read prompts file ({e.strerror})") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
        fields = record if isinstance(record, dict) else {}
        prompt = fields.get("prompt", fields.get("prompt_token_ids")) if fields else record
        ids_ok = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ids_ok:
            raise ValueError(f"{path}:{lineno}: expected a non-empty string, a list of token ids, "
                             "or an object with 'prompt' or 'prompt_token_ids'")
        yield lineno, prompt, fields
