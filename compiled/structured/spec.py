"""What a request's output must match, as vLLM's `StructuredOutputsParams` names it: exactly one
of a JSON schema, any JSON object, a regex, a list of choices or an EBNF grammar.

Only the shape of the request is checked here; whether the schema, regex or grammar itself is
valid is decided when it is parsed (`compiled.structured.grammar`)."""

from __future__ import annotations

import json as json_text
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _fail(requirement: str, value: Any) -> ValueError:
    return ValueError(f"SamplingParams.structured_outputs {requirement}, got {value!r}".replace("\n", " "))


@dataclass(frozen=True)
class StructuredOutputs:
    json: dict | str | None = None       # a JSON schema, as a dict or its JSON text
    json_object: bool = False            # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None           # EBNF, in xgrammar's dialect (GBNF)
    # The constraint starts once the output has produced this text (a reasoning model's
    # `</think>`); before it the model writes freely.
    after: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _fail(f"needs exactly one of {', '.join(KINDS)}", given or "none")
        if self.json is not None and not isinstance(self.json, (dict, str, bool)):
            raise _fail("json must be a schema (an object or its JSON text)", self.json)
        if not isinstance(self.json_object, bool):
            raise _fail("json_object must be true or false", self.json_object)
        for name in ("regex", "grammar", "after"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _fail(f"{name} must be a non-empty string", value)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise _fail("choice must be a non-empty list of non-empty strings", self.choice)
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (the cache key): the kind and its canonical text."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json_text.loads(value) if value.strip() else value
        text = value if isinstance(value, str) else json_text.dumps(value, sort_keys=True, separators=(",", ":"))
        return self.kind, text

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputs | None:
        """None, a StructuredOutputs, or its fields as a dict (vLLM's request field)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise _fail("must be a StructuredOutputs or a dict of its fields", value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise _fail(f"has no field {unknown[0]!r} (fields: {', '.join(sorted(known))})", value)
        return cls(**value)
