"""The grammar of a Qwen3 (hermes) tool call, built from the tools' parameter schemas: each call
is `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` with ARGS valid for NAME's
schema, as the chat template tells the model to write it. It enforces `tool_choice` `required`
(one call or more, separated by a newline) and a named function (exactly one call of it)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from compiled.structured.grammar import check
from compiled.structured.spec import StructuredOutputs

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name and the JSON schema of its arguments."""
    name: str
    parameters: dict = field(default_factory=lambda: {"type": "object"})


def call_schema(tool: Tool) -> dict:
    """The schema of one call's JSON object: its name, then its arguments."""
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def check_parameters(schema: dict) -> None:
    """Raise a ValueError (one line) when `schema` is not a JSON schema the grammar can use."""
    if not isinstance(schema, dict):
        raise ValueError(f"expected a JSON schema object, got {schema!r}")
    try:
        check(StructuredOutputs(json=schema))
    except ValueError as e:
        raise ValueError(str(e).removeprefix("structured_outputs.json: ")) from None


def tool_call_grammar(tools: Sequence[Tool], several: bool) -> str:
    """EBNF (xgrammar's dialect) for one call of any of `tools` or, with `several`, one call or
    more separated by newlines. The JSON is written as the template shows it: `", "` and `": "`
    between items, no other whitespace, so a call always ends."""
    import xgrammar
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    calls = [xgrammar.Grammar.from_json_schema(json.dumps(call_schema(t)), any_whitespace=False,
                                               separators=(", ", ": ")) for t in tools]
    body = calls[0] if len(calls) == 1 else xgrammar.Grammar.union(*calls)
    one = xgrammar.Grammar.concat(xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(OPEN + chr(10))}"), body,
                                  xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(chr(10) + CLOSE)}"))
    text = str(one)
    if not several:
        return text
    # The single call's root becomes a rule of its own, repeated by the new root.
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("root ::= "))
    lines[first] = "tool_call_one ::= " + lines[first].removeprefix("root ::= ")
    grammar = "\n".join([r'root ::= tool_call_one ("\n" tool_call_one)*', *lines]) + "\n"
    xgrammar.Grammar.from_ebnf(grammar)   # the rename must leave a grammar that parses
    return grammar
