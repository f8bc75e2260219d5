"""Qwen3's reasoning: an output that opens with `<think>` reasons until `</think>`; what follows
is the answer. Any other output is all answer. A stream holds back what may still be a tag."""

from __future__ import annotations

from dataclasses import dataclass

THINK, END_THINK = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole output; reasoning None when the output does not think."""
    if not text.startswith(THINK):
        return None, text
    rest = text[len(THINK):]
    end = rest.find(END_THINK)
    if end < 0:   # cut off while thinking
        return rest, ""
    return rest[:end], rest[end + len(END_THINK):]


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (what may still become it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """A streamed output split as `split_reasoning` splits the whole: `feed` takes the next text
    and returns (reasoning, answer) ready to send; `finish` returns what was held back."""
    state: str = "start"    # start: may still open with <think>; reasoning; answer
    held: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        if self.state == "start":
            if THINK.startswith(self.held):
                return "", ""
            if not self.held.startswith(THINK):
                self.state = "answer"
            else:
                self.state, self.held = "reasoning", self.held[len(THINK):]
        if self.state == "answer":
            out, self.held = self.held, ""
            return "", out
        end = self.held.find(END_THINK)
        if end >= 0:
            reasoning, answer = self.held[:end], self.held[end + len(END_THINK):]
            self.state, self.held = "answer", ""
            return reasoning, answer
        keep = partial_suffix(self.held, END_THINK)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, ""

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "start" and held == THINK:
            return "", ""
        if self.state == "reasoning":
            return held, ""
        return "", held
