"""Grammars compiled against a model's vocabulary, once per spec, on background threads.

Compiling a JSON schema takes from a millisecond to seconds (xgrammar: 4.1 s mean over 10k real
schemas), so it never runs on the engine's thread: `get` returns a future at once and a request
waits, unscheduled, until it is done. Building the vocabulary's token table (a pass over 150k
tokens for Qwen3) is the pool's first job, taken only once a constrained request comes."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import xgrammar as xgr

from compiled.structured.grammar import to_grammar
from compiled.structured.spec import StructuredOutputs
from compiled.structured.stats import StatsRecorder

MAX_CACHED = 512   # compiled grammars kept (least recently asked for go first)


@dataclass(frozen=True)
class Vocabulary:
    """xgrammar's view of the tokenizer, for the model's (possibly padded) vocabulary."""
    info: xgr.TokenizerInfo
    compiler: xgr.GrammarCompiler
    token_bytes: list[bytes]   # what each id decodes to (empty for padding ids)

    @property
    def size(self) -> int:
        return self.info.vocab_size


def vocabulary(hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], threads: int = 8) -> Vocabulary:
    """`vocab_size`: the logits' width; ids past the tokenizer's are padding, always masked.
    `stop_token_ids`: the model's EOS ids, allowed only where the grammar may end."""
    size = max(vocab_size, len(hf_tokenizer))
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=size, stop_token_ids=sorted(stop_token_ids))
    token_bytes = [bytes(t) if isinstance(t, bytes) else str(t).encode() for t in info.decoded_vocab]
    return Vocabulary(info, xgr.GrammarCompiler(info, max_threads=threads), token_bytes)


class GrammarCache:
    """Compiled grammars by `StructuredOutputs.key()`. Thread-safe."""

    def __init__(self, make_vocabulary: Callable[[], Vocabulary], workers: int = 2) -> None:
        self.stats = StatsRecorder()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")
        self._vocabulary = self._pool.submit(make_vocabulary)
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def vocabulary(self) -> Vocabulary:
        """The vocabulary (waits for it to be built; raises what building it raised)."""
        return self._vocabulary.result()

    @property
    def vocabulary_future(self) -> Future:
        return self._vocabulary

    def get(self, spec: StructuredOutputs) -> Future:
        """A future of `spec`'s `xgr.CompiledGrammar`; an exception in it is a one-line error."""
        key = spec.key()
        with self._lock:
            self.stats.requests += 1
            future = self._compiled.get(key)
            if future is not None:
                self._compiled.move_to_end(key)
                self.stats.hits += 1
                return future
            future = self._pool.submit(self._compile, spec)
            self._compiled[key] = future
            while len(self._compiled) > MAX_CACHED:
                self._compiled.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_failure(key, f))
        return future

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        grammar = to_grammar(spec)   # parsed here again: a spec may come unchecked
        compiled = self.vocabulary().compiler.compile_grammar(grammar)
        self.stats.compiled(time.perf_counter() - start)
        return compiled

    def _forget_failure(self, key: tuple[str, str], future: Future) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._compiled.get(key) is future:
                    del self._compiled[key]
