"""A chat choice's output read as an assistant message: its reasoning split off (a reasoning
parser, `--reasoning-parser`), its tool calls parsed (a tool-call parser, `--tool-call-parser`,
when the request gave tools and did not say `tool_choice: none`), whole or as stream deltas."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from compiled.server.parsers import reasoning, tool_calls


@dataclass(frozen=True)
class ToolCallFormat:
    """A tool-call parser: the whole output's (text, calls), and a stream's reader."""
    parse: Callable[[str], tuple[str | None, list[tool_calls.ToolCall]]]
    stream: Callable[[], tool_calls.ToolCallStream]


@dataclass(frozen=True)
class ReasoningFormat:
    """A reasoning parser: the whole output's (reasoning, answer), the tag that ends the
    reasoning (where a request's grammar starts) and a stream's reader."""
    split: Callable[[str], tuple[str | None, str]]
    end: str
    stream: Callable[[], reasoning.ReasoningStream]


TOOL_CALL_PARSERS = {"hermes": ToolCallFormat(tool_calls.parse, tool_calls.ToolCallStream)}
TOOL_CALL_PARSERS["qwen3"] = TOOL_CALL_PARSERS["hermes"]   # Qwen3 writes hermes' format
REASONING_PARSERS = {"qwen3": ReasoningFormat(reasoning.split_reasoning, reasoning.END_THINK,
                                              reasoning.ReasoningStream)}


@dataclass(frozen=True)
class ChatOptions:
    """The server's parsers of chat outputs, by name (`--tool-call-parser`, `--reasoning-parser`)."""
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r}: expected one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r}: expected one of "
                             f"{', '.join(REASONING_PARSERS)}")

    def output(self, parse_tools: bool, thinking: bool) -> ChatOutput:
        """How a request's output is read: tool calls when it asks for them to be parsed,
        reasoning unless the request turned thinking off."""
        return ChatOutput(REASONING_PARSERS[self.reasoning_parser] if self.reasoning_parser and thinking else None,
                          TOOL_CALL_PARSERS[self.tool_call_parser] if parse_tools else None)


@dataclass(frozen=True)
class ChatOutput:
    """How one chat request's choices are read (None fields: not read that way)."""
    reasoning: ReasoningFormat | None = None
    tools: ToolCallFormat | None = None

    @property
    def reads(self) -> bool:
        """Whether the output is read at all (else it is the message's content as it is)."""
        return self.reasoning is not None or self.tools is not None

    def message(self, text: str) -> tuple[dict, bool]:
        """The assistant message of a whole output, and whether it calls tools."""
        message: dict = {"role": "assistant"}
        answer = text
        if self.reasoning is not None:
            message["reasoning_content"], answer = self.reasoning.split(text)
        calls = []
        if self.tools is not None:
            answer, calls = self.tools.parse(answer)
        message["content"] = answer if self.reasoning is None and not calls else (answer or None)
        if calls:
            message["tool_calls"] = [c.body() for c in calls]
        return message, bool(calls)

    def stream(self) -> ChatStream:
        return ChatStream(self)


class ChatStream:
    """One streamed choice: `feed` each new text, giving the chunk's delta (empty when all of
    it is held back: what may begin a tag)."""

    def __init__(self, output: ChatOutput) -> None:
        self.reasoning = output.reasoning.stream() if output.reasoning is not None else None
        self.tools = output.tools.stream() if output.tools is not None else None
        self.called = False   # whether a tool call was streamed

    def feed(self, text: str, last: bool = False) -> dict:
        """The delta of `text`, the output's next piece (`last`: and the end of it)."""
        thought, answer = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        if last and self.reasoning is not None:
            more_thought, more_answer = self.reasoning.finish()
            thought, answer = thought + more_thought, answer + more_answer
        if self.tools is None:
            return self._delta(thought, answer, [])
        answer, calls = self.tools.feed(answer)
        if last:
            more_answer, more_calls = self.tools.finish()
            answer, calls = answer + more_answer, calls + more_calls
        return self._delta(thought, answer, calls)

    def _delta(self, thought: str, text: str, calls: list[dict]) -> dict:
        delta: dict = {}
        if thought:
            delta["reasoning_content"] = thought
        if text:
            delta["content"] = text
        if calls:
            self.called = True
            delta["tool_calls"] = _merged(calls)
        return delta


def _merged(deltas: list[dict]) -> list[dict]:
    """One entry a call: a call's pieces in one chunk joined (its start and first arguments)."""
    merged: list[dict] = []
    for d in deltas:
        if merged and merged[-1]["index"] == d["index"]:
            last = merged[-1]
            last["function"] = {**last["function"],
                                "arguments": last["function"]["arguments"] + d["function"]["arguments"]}
        else:
            merged.append({**d, "function": dict(d["function"])})
    return merged
