"""Qwen3's tool calls (the hermes format): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`, one block a call, the answer's text around them. `parse` reads a whole output;
`ToolCallStream` turns a stream of text into OpenAI's deltas: a call's index, id, type and name
first, then its arguments piece by piece, with what may still be a tag held back.

Both read the same way: a call's arguments are its JSON text as the model wrote it; whitespace
next to a call's tags is not text of the answer; an unclosed call at the end of the output is
read as far as its JSON goes."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from compiled.server.parsers.reasoning import partial_suffix
from compiled.structured.tools import CLOSE, OPEN

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'\s*,\s*"arguments"\s*:\s*')


@dataclass
class ToolCall:
    name: str
    arguments: str     # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _members(text: str) -> dict[str, tuple[object, str]] | None:
    """A JSON object's members: key -> (value, its text as written); None if `text` is not one."""
    decoder, ws = json.JSONDecoder(), re.compile(r"\s*")
    i = ws.match(text, 0).end()
    if text[i:i + 1] != "{":
        return None
    members, i = {}, ws.match(text, i + 1).end()
    try:
        while text[i:i + 1] != "}":
            key, i = decoder.raw_decode(text, i)
            i = ws.match(text, i).end()
            if not isinstance(key, str) or text[i:i + 1] != ":":
                return None
            start = ws.match(text, i + 1).end()
            value, i = decoder.raw_decode(text, start)
            members[key] = (value, text[start:i])
            i = ws.match(text, i).end()
            if text[i:i + 1] == ",":
                i = ws.match(text, i + 1).end()
            elif text[i:i + 1] != "}":
                return None
    except json.JSONDecodeError:
        return None
    return members if not text[i + 1:].strip() else None


def read_call(body: str) -> ToolCall | None:
    """The call a block's JSON names, or None when it is not a call."""
    members = _members(body)
    if members is None or not isinstance(members.get("name", (None,))[0], str):
        return None
    arguments = members.get("arguments", ({}, "{}"))
    if isinstance(arguments[0], str):   # arguments given as JSON text
        return ToolCall(members["name"][0], arguments[0])
    if not isinstance(arguments[0], dict):
        return None
    return ToolCall(members["name"][0], arguments[1])


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """(the answer's text, the calls) of a whole output; a block that is not a call leaves the
    whole output as text, with no calls."""
    parts, calls, pos = [], [], 0
    while (start := text.find(OPEN, pos)) >= 0:
        parts.append(text[pos:start])
        end = text.find(CLOSE, start)
        call = read_call(text[start + len(OPEN):end if end >= 0 else len(text)])
        if call is None:
            return text, []
        calls.append(call)
        pos = end + len(CLOSE) if end >= 0 else len(text)
    if not calls:
        return text, []
    parts.append(text[pos:])
    # whitespace next to a tag belongs to the tag
    kept = [p.lstrip() if i else p for i, p in enumerate(parts)]
    kept = [p.rstrip() if i < len(kept) - 1 else p for i, p in enumerate(kept)]
    content = "".join(kept)
    return content or None, calls


class _JSONEnd:
    """Finds where a JSON object or array ends, reading its text as it grows."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.seen = 0, False, False, 0
        self.end: int | None = None

    def feed(self, text: str) -> int | None:
        for i in range(self.seen, len(text)):
            ch = text[i]
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
                    break
        self.seen = len(text)
        return self.end


@dataclass
class _Open:
    """The call being streamed: its text since `<tool_call>` and how much of it went out."""
    index: int
    text: str = ""
    call: ToolCall | None = None   # once its name is known
    name_end: int = 0
    args_at: int | None = None     # where its arguments' JSON starts in `text`
    sent: int = 0                  # characters of the arguments sent
    scan: _JSONEnd = field(default_factory=_JSONEnd)


def _start(index: int, call: ToolCall) -> dict:
    return {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}


def _arguments(index: int, piece: str) -> dict:
    return {"index": index, "function": {"arguments": piece}}


class ToolCallStream:
    """A stream's text in, OpenAI's delta pieces out: `feed(text)` and `finish()` each return
    (answer text, tool-call deltas) ready to send, read as `parse` reads the whole."""

    def __init__(self) -> None:
        self.held = ""            # text not sent yet: what may begin a tag, whitespace next to one
        self.after_call = False   # leading whitespace here follows a call's end
        self.open: _Open | None = None
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        out, deltas = "", []
        while True:
            if self.open is not None:
                piece, new = self._in_call()
                out, deltas = out + piece, deltas + new
                if self.open is not None:
                    return out, deltas
            start = self.held.find(OPEN)
            if start < 0:
                keep = partial_suffix(self.held, OPEN)
                body, ws = self._text(self.held[:len(self.held) - keep])
                self.held = ws + self.held[len(self.held) - keep:]
                return out + body, deltas
            out += self._text(self.held[:start], before_call=True)[0]
            self.open, self.held = _Open(self.calls), self.held[start + len(OPEN):]
            self.calls += 1

    def finish(self) -> tuple[str, list[dict]]:
        out, deltas = "", []
        if self.open is not None:   # unclosed at the end: read as far as its JSON goes
            out, deltas = self.feed(CLOSE)
        body, _ = self._text(self.held, last=True)
        self.held = ""
        return out + body, deltas

    def _text(self, text: str, before_call: bool = False, last: bool = False) -> tuple[str, str]:
        """(answer text to send, whitespace to hold) of `text`: whitespace after a call's end or
        before a call's start is not the answer's; trailing whitespace waits to see which."""
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        if before_call:
            return text.rstrip(), ""
        body = text if last else text.rstrip()
        return body, text[len(body):]

    def _in_call(self) -> tuple[str, list[dict]]:
        """What the open call's text gives so far: its start, its arguments' new piece, its end."""
        o, deltas = self.open, []
        o.text, self.held = o.text + self.held, ""
        end = o.text.find(CLOSE)
        body = o.text if end < 0 else o.text[:end]
        if o.call is None and (m := _NAME.match(body)):
            o.call, o.name_end = ToolCall(json.loads(f'"{m[1]}"'), ""), m.end()
            deltas.append(_start(o.index, o.call))
        if o.call is not None and o.args_at is None and (m := _ARGS.match(body, o.name_end)) \
                and m.end() < len(body) and body[m.end()] in "{[":
            o.args_at = m.end()
        if o.args_at is not None:
            args = body[o.args_at:]
            upto = o.scan.feed(args) or len(args) - (partial_suffix(args, CLOSE) if end < 0 else 0)
            if upto > o.sent:
                deltas.append(_arguments(o.index, args[o.sent:upto]))
                o.sent = upto
        if end < 0:
            return "", deltas
        self.open, self.held, self.after_call = None, o.text[end + len(CLOSE):], True
        return self._closed(o, body, deltas)

    def _closed(self, o: _Open, body: str, deltas: list[dict]) -> tuple[str, list[dict]]:
        call = read_call(body)
        if call is None:   # not a call after all: its text is the answer's
            self.after_call = False
            return OPEN + body + CLOSE, deltas
        if o.call is None:
            o.call = call
            deltas.append(_start(o.index, call))
        sent = body[o.args_at:o.args_at + o.sent] if o.args_at is not None else ""
        if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
            deltas.append(_arguments(o.index, call.arguments[len(sent):]))
        return "", deltas
