"""`--structured json` of the benchmarks: one fixed JSON schema on every request, and what its
masks and compilations cost beside the step time.

The schema is a realistic record list that cannot end within a benchmark's output (at least 64
records), so every step of every row is masked. A model without a tokenizer (a config-only folder
with `--load-format dummy`) gets a stand-in vocabulary of its size: the 256 bytes, then
byte-level-BPE-like pieces (words with and without a leading space, digit runs, JSON punctuation
runs), so the masks cost what they would with a real tokenizer of that size."""

from __future__ import annotations

import random

import xgrammar as xgr

from compiled.structured.compiler import Vocabulary

STRUCTURED = ("json",)

SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array", "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "name": {"type": "string", "maxLength": 24},
                    "score": {"type": "number"},
                    "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
                    "active": {"type": "boolean"},
                },
                "required": ["id", "name", "score", "kind", "tags", "active"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["records"],
    "additionalProperties": False,
}

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_PUNCTUATION = ['"', ",", ":", "{", "}", "[", "]", '":', '",', '":"', '"}', '"]', "},", "],", '{"', '["', "}}", " {",
                '":{', '":[', "null", "true", "false"]


def stand_in_vocabulary(size: int, stop_token_ids: list[int], seed: int = 0) -> Vocabulary:
    """`size` tokens as described above; the stop ids are special tokens."""
    if size < 512:
        raise ValueError(f"--structured: the model has no tokenizer and its vocabulary of {size} ids is too small for "
                         "a stand-in one (at least 512: the 256 bytes and more)")
    rng = random.Random(seed)
    tokens, seen = [bytes([b]) for b in range(256)], set()
    while len(tokens) < size:
        kind = rng.random()
        if kind < 0.7:
            piece = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 9)))
            piece = (" " + piece) if rng.random() < 0.5 else piece
        elif kind < 0.85:
            piece = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 4)))
        else:
            piece = "".join(rng.choice(_PUNCTUATION) for _ in range(rng.randint(1, 3)))
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece.encode())
    for i, stop in enumerate(stop_token_ids):
        if stop < size:
            tokens[stop] = f"<|stop{i}|>".encode()
    info = xgr.TokenizerInfo(tokens[:size], xgr.VocabType.RAW, vocab_size=size, stop_token_ids=stop_token_ids)
    return Vocabulary(info, xgr.GrammarCompiler(info, max_threads=8), tokens[:size])


def check(kind: str | None) -> None:
    if kind not in (None, *STRUCTURED):
        raise ValueError(f"--structured {kind!r}: choose from {', '.join(STRUCTURED)}")


def prepare(llm, kind: str | None, seed: int) -> dict | None:
    """The `structured_outputs` every request of the run carries (None without `--structured`);
    gives a model without a tokenizer the stand-in vocabulary."""
    check(kind)
    if kind is None:
        return None
    engine = llm.engine
    if engine.constraints.make_vocabulary is None:
        size, stops = llm.model_config.vocab_size, sorted(engine.eos_token_ids)
        engine.constraints.make_vocabulary = lambda: stand_in_vocabulary(size, stops, seed)
    return {"json": SCHEMA}


def results(engine) -> dict:
    """The engine's structured-output statistics, in milliseconds."""
    s = engine.structured_stats()
    return {"requests": s.requests, "compiles": s.compiles, "compile_cache_hits": s.compile_cache_hits,
            "compile_ms": {"p50": 1e3 * s.compile_seconds_p50, "p99": 1e3 * s.compile_seconds_p99,
                           "max": 1e3 * s.compile_seconds_max},
            "mask_steps": s.mask_steps, "mask_rows": s.mask_rows,
            "mask_ms": {"p50": 1e3 * s.mask_seconds_p50, "p99": 1e3 * s.mask_seconds_p99}}
