"""Stop strings, found in a request's output text as it grows, the way vLLM finds them: the one
implementation the engine (`Engine._append`) and the server's front end (which decodes beside the
engine's process) both run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from compiled.runtime.sampling_params import SamplingParams

__all__ = ["StopChecker", "StopMatch", "find_stop"]


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
    would have completed first). As every stop condition, a stop string counts from
    the request's ``min_new_tokens``-th output token on.
    """

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        # A bare string would be iterated char by char; accept it as one stop string.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        object.__setattr__(self, "stop", stop)

    @classmethod
    def of(cls, params: SamplingParams) -> StopChecker | None:
        """The checker of a request's `SamplingParams`; None when it has no stop strings."""
        if not params.stop:
            return None
        return cls(tuple(params.stop), params.include_stop_str_in_output, params.min_new_tokens)

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    @property
    def hold_back_chars(self) -> int:
        """Trailing chars a streaming server must withhold: they may yet begin a stop string."""
        return max(self.max_stop_len - 1, 0)

    def check(self, output_text: str, delta: str, num_tokens: int | None = None) -> StopMatch | None:
        """``output_text`` already ends with ``delta``; returns the match, if any, with the truncated text.
        ``num_tokens``: the output's tokens with the one that made ``delta`` (None: past
        ``min_new_tokens``)."""
        if not delta or (num_tokens is not None and num_tokens < self.min_new_tokens):
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
