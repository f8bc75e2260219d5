"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked: the tools go to the
chat template; `required` and a named function become a grammar over the tools' parameter
schemas (`compiled.structured.tools`); `auto` lets the model choose, read by the tool-call
parser; `none` leaves the output as text."""

from __future__ import annotations

import json
from dataclasses import dataclass

from compiled.server.protocol import bad
from compiled.structured.spec import StructuredOutputs
from compiled.structured.tools import Tool, check_parameters, tool_call_grammar


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]          # as given (OpenAI's shape), for the chat template
    choice: str                # auto, none, required, or function (a named one: `function`)
    parallel: bool             # whether `required` may make several calls
    function: str | None = None

    @property
    def parses(self) -> bool:
        """Whether the output is read for tool calls."""
        return bool(self.tools) and self.choice != "none"

    def constraint(self) -> StructuredOutputs | None:
        """The grammar enforcing `required` or a named function (None for auto and none)."""
        if not self.tools or self.choice in ("auto", "none"):
            return None
        tools = [Tool(t["function"]["name"], t["function"].get("parameters") or {"type": "object"})
                 for t in self.tools]
        if self.choice == "function":
            return StructuredOutputs(grammar=tool_call_grammar([t for t in tools if t.name == self.function], False))
        return StructuredOutputs(grammar=tool_call_grammar(tools, self.parallel))


def tool_request(body: dict) -> ToolRequest:
    """The request's tools and choice; a 400 naming the field at fault."""
    tools = body.get("tools")
    tools = [] if tools is None else tools
    if not isinstance(tools, list):
        raise bad("tools", f"expected a list of tools, got {tools!r}")
    names = [_tool_name(i, t) for i, t in enumerate(tools)]
    if len(set(names)) != len(names):
        raise bad("tools", f"function names must be distinct, got {names}")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"expected true or false, got {parallel!r}")
    choice = _choice(body.get("tool_choice"), names)
    if isinstance(choice, dict):
        return ToolRequest(tools, "function", parallel, choice["name"])
    return ToolRequest(tools, choice, parallel)


def _tool_name(i: int, tool) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad("tools", f"{where}: expected {{\"type\": \"function\", \"function\": {{...}}}}, got "
                  f"{json.dumps(tool)[:200]}")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad("tools", f"{where}.function.name: expected a non-empty string, got {name!r}")
    parameters = function.get("parameters")
    if parameters is not None:
        try:
            check_parameters(parameters)
        except ValueError as e:
            raise bad("tools", f"{where}.function.parameters is not a JSON schema: {e}") from None
    return name


def _choice(value, names: list[str]) -> str | dict:
    """`tool_choice` as a word, or the named function's name (`{"type": "function", ...}`); the
    default is auto with tools, else none."""
    if value is None:
        return "auto" if names else "none"
    if isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise bad("tool_choice", f"expected auto, none, required or {{\"type\": \"function\", \"function\": "
                      f"{{\"name\": ...}}}}, got {value!r}")
        if name not in names:
            raise bad("tool_choice", f"names function {name!r}, which is not among the tools "
                      f"({', '.join(names) or 'none given'})")
        return {"name": name}
    if value not in ("auto", "none", "required"):
        raise bad("tool_choice", f"expected auto, none, required or a named function, got {value!r}")
    if value == "required" and not names:
        raise bad("tool_choice", "required needs tools")
    return value
