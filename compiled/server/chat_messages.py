"""A chat request's `messages` as the chat template takes them: content as text (a string, or
OpenAI's text parts joined), an assistant's `tool_calls` (its content may then be null) and the
`tool` messages that answer them. Anything else is a 400 naming `messages`."""

from __future__ import annotations

from compiled.server.protocol import bad


def chat_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise bad("messages", "expected a non-empty list of {\"role\", \"content\"} objects")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: dict) -> dict:
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and calls:
        _check_calls(i, calls)
        return {**m, "content": "" if m.get("content") is None else _text_content(m["content"])}
    if m["role"] == "tool" and not isinstance(m.get("tool_call_id", ""), str):
        raise bad("messages", f"messages[{i}].tool_call_id: expected a string, got {m['tool_call_id']!r}")
    return {**m, "content": _text_content(m.get("content"))}


def _check_calls(i: int, calls) -> None:
    """An assistant's tool calls: a list of {"function": {"name", "arguments"}} (arguments as
    JSON text or an object)."""
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", ""), (str, dict)) for c in calls)
    if not ok:
        raise bad("messages", f"messages[{i}].tool_calls: expected a list of {{\"type\": \"function\", "
                  f"\"function\": {{\"name\", \"arguments\"}}}}, got {calls!r}"[:300])


def _text_content(content) -> str:
    """A message's content as text: a string, or OpenAI's list of parts, of which only text ones
    are served (joined by newlines, as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "\n".join(p["text"] for p in content)
        kinds = sorted({str(p.get("type")) for p in content if p.get("type") != "text"})
        raise bad("messages", f"only text content is served, got parts of type {', '.join(kinds) or 'text'} "
                  "without a string text")
    raise bad("messages", f"a message's content must be a string or a list of text parts, got {content!r}")
