"""A `StructuredOutputs` as an xgrammar `Grammar`, parsed without a tokenizer.

JSON schemas are written with compact separators and no free whitespace: a model that knows
nothing of JSON can only continue a value or close it, so it ends with valid output rather than
looping on spaces until its token limit (a known pain of guided JSON elsewhere). Unknown
properties and items are refused (xgrammar's strict mode, vLLM's default), which also bounds the
output. `json_object` is any JSON object, written compactly. A choice is an alternation of its
literal strings; a grammar is EBNF in xgrammar's dialect (GBNF)."""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from compiled.structured.spec import StructuredOutputs

# JSON's separators without spaces: `{"a":1,"b":[true,false]}`.
SEPARATORS = (",", ":")
# xgrammar's messages start with where they were raised in its C++ sources.
_SOURCE_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")
_WHAT = {"json": "invalid JSON schema", "json_object": "invalid JSON object grammar", "regex": "invalid regex",
         "choice": "invalid choice", "grammar": "invalid EBNF grammar"}


def _json_schema(spec: StructuredOutputs) -> xgr.Grammar:
    schema = spec.json
    if isinstance(schema, str):
        schema = json.loads(schema)   # a JSONDecodeError names the line and column
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a schema is an object or a boolean, not {type(schema).__name__}")
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)


def _json_object() -> xgr.Grammar:
    # Not strict: any member, of any value, may appear.
    return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, separators=SEPARATORS,
                                        strict_mode=False)


def _choice(spec: StructuredOutputs) -> xgr.Grammar:
    # A JSON string literal is a valid EBNF string literal (the same escapes).
    return xgr.Grammar.from_ebnf("root ::= " + " | ".join(f"({json.dumps(c)})" for c in spec.choice))


def to_grammar(spec: StructuredOutputs) -> xgr.Grammar:
    """The grammar `spec` asks for; a ValueError naming the field (`structured_outputs.<kind>`)
    and what is wrong, in one line, when it does not parse."""
    try:
        if spec.kind == "json":
            return _json_schema(spec)
        if spec.kind == "json_object":
            return _json_object()
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if spec.kind == "choice":
            return _choice(spec)
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.{spec.kind}: {_WHAT[spec.kind]}: {_one_line(e)}") from None


def check(spec: StructuredOutputs | dict) -> StructuredOutputs:
    """Parse `spec` (a StructuredOutputs or a dict of its fields) without a tokenizer; returns it
    as a StructuredOutputs, or raises a one-line ValueError naming the field at fault (what a
    server answers with a 400)."""
    spec = StructuredOutputs.from_value(spec)
    to_grammar(spec)
    return spec


def _one_line(error: BaseException) -> str:
    text = _SOURCE_PREFIX.sub("", str(error)).strip()
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    return text if len(text) <= 300 else text[:297] + "..."
