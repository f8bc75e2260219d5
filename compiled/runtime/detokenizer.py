"""Token-by-token text output, following vLLM: ``IncrementalDetokenizer`` turns each
sampled id into the text it adds, decoding only a short window of ids per step (the
stop strings found in that text: ``stop.py``).
"""

from __future__ import annotations

from typing import Sequence

from compiled.runtime.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

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
