"""Token-by-token text output and stop-string handling, following vLLM.

``IncrementalDetokenizer`` turns each sampled id into the text it adds, decoding
only a short window of ids per step. ``StopChecker`` finds stop strings in the
accumulated text and truncates it the way vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from compiled.runtime.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopChecker", "StopMatch", "find_stop"]

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: how many prompt ids seed the window,
# so the first output token is rendered in context (e.g. a sentencepiece "▁word" keeps
# its leading space, and a byte-level char split across the prompt boundary decodes).
_PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Per-request streaming decoder: ``step(id)`` returns the text that id adds.

    State is a window of ids ``[prefix | unread]``: ``prefix`` ids were already
    emitted and only give context; text is emitted once decoding the whole window
    yields more than the prefix alone and does not end in U+FFFD, the mark of a
    multi-byte character whose remaining bytes are still to come. After an
    emission the window shrinks to the ids just read, so each step decodes a
    handful of ids regardless of output length.

    The deltas concatenate to ``tokenizer.decode(output_ids)`` for valid text,
    except that with a prompt a leading sentencepiece space is kept (as in vLLM).
    A character the model leaves unfinished at the end is never emitted.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = prompt_token_ids[max(len(prompt_token_ids) - _PROMPT_CONTEXT_TOKENS, 0):]
        self._window: list[int] = [int(i) for i in context]
        self._read = len(self._window)  # window[:_read] is the already-emitted prefix
        self._prefix_text = self._decode(self._window)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def step(self, new_token_id: int) -> str:
        """Appends one sampled id; returns the new text (possibly "") it completes."""
        self._window.append(int(new_token_id))
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            # Nothing visible yet, or the last character is still incomplete: hold back.
            return ""
        delta = text[len(self._prefix_text):]
        # What was just read becomes the context for the next step.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta

    def step_many(self, new_token_ids: Sequence[int]) -> str:
        """Convenience for several ids at once (e.g. speculative tokens); same result as stepping each."""
        return "".join(self.step(i) for i in new_token_ids)


@dataclass(frozen=True)
class StopMatch:
    """A stop string that ended generation and the output text to return."""

    stop_str: str
    text: str


@dataclass(frozen=True)
class StopChecker:
    """Finds stop strings in streamed output text, vLLM style.

    Call ``check`` after every non-empty delta. Only text that could hold a match
    ending inside the delta is searched. On a match the text is cut before the stop
    string, or right after it with ``include_stop_str_in_output``. When several stop
    strings match, the one starting earliest wins (the shorter on a tie, since it
    would have completed first).
    """

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # A bare string would be iterated char by char; accept it as one stop string.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        object.__setattr__(self, "stop", stop)

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    @property
    def hold_back_chars(self) -> int:
        """Trailing chars a streaming server must withhold: they may yet begin a stop string."""
        return max(self.max_stop_len - 1, 0)

    def check(self, output_text: str, delta: str) -> StopMatch | None:
        """``output_text`` already ends with ``delta``; returns the match, if any, with the truncated text."""
        if not delta:
            return None
        hit = find_stop(output_text, self.stop, self.include_stop_str_in_output, new_chars=len(delta))
        return None if hit is None else StopMatch(stop_str=hit[1], text=hit[0])


def find_stop(
    text: str,
    stop: Sequence[str],
    include_stop_str_in_output: bool = False,
    new_chars: int | None = None,
) -> tuple[str, str] | None:
    """Returns ``(truncated_text, stop_str)`` for the earliest stop string in ``text``, else None.

    With ``new_chars`` only matches ending in the last ``new_chars`` chars count (they
    are the only new ones when called after every delta); None searches all of ``text``.
    Earliest start wins; on a tie the shorter string, since it would have completed first.
    """
    new_start = 0 if new_chars is None else len(text) - new_chars
    best: tuple[int, str] | None = None
    for s in stop:
        if not s:
            continue
        # A match ending inside the new text starts at most len(s)-1 chars before it.
        index = text.find(s, max(new_start - len(s) + 1, 0))
        if index >= 0 and (best is None or (index, len(s)) < (best[0], len(best[1]))):
            best = (index, s)
    if best is None:
        return None
    index, s = best
    end = index + len(s) if include_stop_str_in_output else index
    return text[:end], s


def stop_hit(text: str, delta: str, params) -> tuple[str, str] | None:
    """After `delta` (the newest decoded text) was added to `text`: the request's stop string it
    completes, as `find_stop` gives it (text cut there, the string), or None."""
    if not (params.stop and delta):
        return None
    return find_stop(text, params.stop, params.include_stop_str_in_output, len(delta))
