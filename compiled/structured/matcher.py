"""One request's progress through its grammar: the matcher that has taken every output token so
far (so a request that is retracted and recomputed keeps it as it is), and, with `after`, the
text it watches for before the grammar starts.

Each choice of an `n > 1` request is a request of its own, with a matcher of its own over the
compiled grammar they share."""

from __future__ import annotations

from concurrent.futures import Future

import xgrammar as xgr

from compiled.structured.compiler import Vocabulary
from compiled.structured.spec import StructuredOutputs


class RequestGrammar:
    def __init__(self, spec: StructuredOutputs, compiled: Future, vocabulary: Future) -> None:
        self.spec = spec
        self._compiled, self._vocabulary = compiled, vocabulary
        self._after = spec.after.encode() if spec.after else None
        self._seen = b""    # the output's last bytes while waiting for `after`
        self.matcher: xgr.GrammarMatcher | None = None
        self.rejected: int | None = None   # a token the grammar did not allow (it was not masked)

    @property
    def ready(self) -> bool:
        """Whether compiling is over (successfully or not)."""
        return self._compiled.done()

    @property
    def error(self) -> str | None:
        """Why the grammar could not be compiled (once `ready`), else None."""
        if not self._compiled.done() or self._compiled.exception() is None:
            return None
        error = self._compiled.exception()
        return str(error) if isinstance(error, ValueError) else f"grammar compilation failed: {error}"

    def wait(self, timeout: float) -> None:
        try:
            self._compiled.exception(timeout=timeout)
        except TimeoutError:
            pass

    @property
    def active(self) -> bool:
        """Whether the next token is masked: compiled, and `after` (if any) seen."""
        if self.matcher is None and self._after is None and self.ready and self.error is None:
            self.matcher = xgr.GrammarMatcher(self._compiled.result())
        return self.matcher is not None and not self.matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        """The grammar took a stop token (it had ended): the output is complete."""
        return self.matcher is not None and self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Take the token the request produced; False when the grammar refused it."""
        if self.matcher is not None:
            if self.matcher.is_terminated() or self.matcher.accept_token(token):
                return True
            self.rejected = token
            return False
        if self._after is not None:
            self._watch(token)
        return True

    def _watch(self, token: int) -> None:
        vocabulary: Vocabulary = self._vocabulary.result()
        seen = self._seen + (vocabulary.token_bytes[token] if token < len(vocabulary.token_bytes) else b"")
        if self._after in seen:
            # The grammar starts with the next token (what followed `after` inside this one is free).
            self.matcher = xgr.GrammarMatcher(self._compiled.result())
            self._seen = b""
        else:
            self._seen = seen[-(len(self._after) - 1):] if len(self._after) > 1 else b""
