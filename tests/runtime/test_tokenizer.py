"""Tokenizer loading, incremental detokenization and stop strings, on tokenizers built here (no downloads)."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from compiled.runtime.detokenizer import IncrementalDetokenizer
from compiled.runtime.stop import StopChecker, find_stop
from compiled.runtime.tokenizer import SentencePieceTokenizer, Tokenizer, has_tokenizer, load_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Mostly ASCII so that the tiny vocabularies leave multi-byte chars split over several tokens.
CORPUS = [
    "Hello world, this is a small test corpus.",
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split text into pieces; pieces map to ids.",
    "Café, naïve and résumé have accents.",
    "日本語 and 中文 and 😀 appear once.",
] * 40

# Pieces for random texts: accents, CJK, emoji and chars never seen in training (byte fallback).
TEXT_PIECES = [
    "hello", " world", "the", " fox", " ", "  ", "\n", ",", ".", "a", "b", "z", "7", "STOP",
    "é", "ü", "ñ", "ß", "日", "本", "語", "中", "文", "😀", "🎉", "🦀", "👍🏽", "Ж", "ॐ", "€", "𝄞",
]


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(TEXT_PIECES) for _ in range(rng.randint(1, 30))) for _ in range(count)]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen-like byte-level BPE saved as tokenizer.json + tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("bpe")
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    rust.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=rust, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-like sentencepiece BPE with byte fallback: only tokenizer.model + tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("spm")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        model_type="bpe",
        vocab_size=360,
        byte_fallback=True,
        character_coverage=0.99,  # rare chars (CJK, emoji) are left to byte fallback
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        # Real Llama configs say this; it must not drag in protobuf.
        "legacy": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def bpe(bpe_dir: Path) -> Tokenizer:
    return load_tokenizer(str(bpe_dir))


@pytest.fixture(scope="module")
def sp(spm_dir: Path) -> Tokenizer:
    return load_tokenizer(str(spm_dir))


@pytest.fixture(scope="module")
def sp_reference(spm_dir: Path) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))


def output_ids(tok: Tokenizer, text: str) -> list[int]:
    """Ids as a model would sample them for ``text``: no BOS."""
    return [i for i in tok.encode(text) if i != tok.bos_token_id]


def stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens)
    return [detok.step(i) for i in ids]


# --- loading -------------------------------------------------------------------------------------


def test_fast_bpe_loads_and_round_trips(bpe: Tokenizer) -> None:
    assert bpe.hf.is_fast
    assert bpe.eos_token_id == bpe.hf.convert_tokens_to_ids("<|im_end|>")
    assert bpe.eos_token_id in bpe.all_special_ids
    assert bpe.vocab_size == len(bpe.hf)
    for text in random_texts(0, 50) + ["Café 😀 日本語"]:
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
    # Byte-level BPE adds no BOS, matching Qwen.
    assert bpe.encode("hello") == bpe.hf.encode("hello", add_special_tokens=False)


def test_special_tokens_decode(bpe: Tokenizer) -> None:
    ids = bpe.encode("hi<|im_end|>")
    assert ids[-1] == bpe.eos_token_id
    assert bpe.decode(ids) == "hi"
    assert bpe.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"


def test_sentencepiece_model_loads_without_tokenizer_json(
    sp: Tokenizer, sp_reference: spm.SentencePieceProcessor, spm_dir: Path
) -> None:
    assert not (spm_dir / "tokenizer.json").exists()
    assert isinstance(sp.hf, SentencePieceTokenizer)
    assert sp.bos_token_id == sp_reference.bos_id()
    assert sp.eos_token_id == sp_reference.eos_id()
    assert sp.vocab_size == sp_reference.get_piece_size()
    for text in random_texts(1, 50) + ["Café 😀 日本語"]:
        ids = sp.encode(text)
        # Exactly sentencepiece's own segmentation, behind a BOS (add_bos_token).
        assert ids == [sp_reference.bos_id()] + sp_reference.encode(text)
        assert sp.decode(ids) == text
        assert sp.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_sentencepiece_backend_class_named_in_config_is_honoured(
    spm_dir: Path, tmp_path: Path, sp_reference: spm.SentencePieceProcessor
) -> None:
    folder = tmp_path / "sw3"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes((spm_dir / "tokenizer.model").read_bytes())
    config = {"tokenizer_class": "GPTSw3Tokenizer", "keep_accents": True, "add_bos_token": False,
              "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(folder)
    assert type(tok.hf).__name__ == "GPTSw3Tokenizer"
    for text in ["Café 😀 日本語", "the fox\nthe dog"]:
        ids = tok.encode(text)
        assert ids == sp_reference.encode(text)
        assert "".join(stream(tok, [], ids)) == tok.decode(ids) == text
    assert tok.apply_chat_template("hi").endswith("<|im_start|>assistant\n")


def test_sentencepiece_uses_byte_fallback(sp: Tokenizer) -> None:
    tokens = sp.convert_ids_to_tokens(output_ids(sp, "🦀"))
    assert tokens[-4:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"]
    assert sp.convert_tokens_to_string(tokens) == "🦀"


@pytest.mark.parametrize("make", [lambda p: p, lambda p: p / "missing"], ids=["empty", "nonexistent"])
def test_folder_without_tokenizer_is_one_line_error(tmp_path: Path, make) -> None:
    folder = make(tmp_path / "no_tokenizer_here")
    (tmp_path / "no_tokenizer_here").mkdir()
    (tmp_path / "no_tokenizer_here" / "config.json").write_text("{}")
    assert not has_tokenizer(folder)
    with pytest.raises(ValueError) as info:
        load_tokenizer(str(folder))
    message = str(info.value)
    assert str(folder) in message
    assert "\n" not in message


def test_has_tokenizer(bpe_dir: Path, spm_dir: Path) -> None:
    assert has_tokenizer(bpe_dir) and has_tokenizer(str(spm_dir))


def test_chat_template(bpe: Tokenizer, sp: Tokenizer) -> None:
    prompt = bpe.apply_chat_template("What is 2+2?")
    assert prompt == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert bpe.decode(bpe.encode(prompt), skip_special_tokens=False) == prompt
    with pytest.raises(ValueError, match="no chat template"):
        sp.apply_chat_template("hi")


# --- incremental detokenization --------------------------------------------------------------


def test_multibyte_chars_span_several_tokens(bpe: Tokenizer, sp: Tokenizer) -> None:
    # Otherwise the hold-back tests below would prove nothing.
    for tok in (bpe, sp):
        assert len(output_ids(tok, "🦀")) >= 3
        assert "\ufffd" in tok.decode(output_ids(tok, "🦀")[:-1])


@pytest.mark.parametrize("name", ["bpe", "sp"])
def test_deltas_concatenate_to_full_decode(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    held_back = 0
    for text in random_texts(2, 200):
        ids = output_ids(tok, text)
        deltas = stream(tok, [], ids)
        assert "".join(deltas) == tok.decode(ids) == text
        assert all("\ufffd" not in d for d in deltas)
        held_back += deltas.count("")
    assert held_back > 0


def test_deltas_with_prompt_context_bpe(bpe: Tokenizer) -> None:
    prompt = bpe.encode(bpe.apply_chat_template("Say something in Japanese 日本語"))
    for text in random_texts(3, 100):
        ids = output_ids(bpe, text)
        deltas = stream(bpe, prompt, ids)
        assert "".join(deltas) == bpe.decode(ids)
        assert all("\ufffd" not in d for d in deltas)


def test_deltas_with_prompt_context_sentencepiece(sp: Tokenizer) -> None:
    # As in vLLM, the first token is decoded after the prompt's last ids, so a leading
    # "▁" renders as a space that a standalone decode of the output would strip.
    prompt = sp.encode("Hello world")
    for text in random_texts(4, 100):
        ids = output_ids(sp, text)
        joined = "".join(stream(sp, prompt, ids))
        full = sp.decode(ids)
        assert joined == full or joined == " " + full
        assert "\ufffd" not in joined
    assert "".join(stream(sp, prompt, output_ids(sp, "fox"))) == " fox"


def test_special_tokens_kept_when_not_skipped(bpe: Tokenizer) -> None:
    ids = bpe.encode("日本<|im_end|>")
    assert "".join(stream(bpe, [], ids, skip_special_tokens=False)) == "日本<|im_end|>"
    assert "".join(stream(bpe, [], ids, skip_special_tokens=True)) == "日本"


def test_unfinished_char_is_never_emitted(bpe: Tokenizer) -> None:
    ids = output_ids(bpe, "ok 🦀")
    deltas = stream(bpe, [], ids[:-1])
    assert "".join(deltas) == "ok "


def test_window_stays_small(bpe: Tokenizer) -> None:
    text = "the quick brown fox 日本語 😀 " * 200
    detok = IncrementalDetokenizer(bpe, bpe.encode("prompt"), True)
    out = []
    for i in output_ids(bpe, text):
        out.append(detok.step(i))
        assert len(detok._window) <= 8
    assert "".join(out) == text


# --- stop strings ------------------------------------------------------------------------------


def stream_until_stop(tok: Tokenizer, text: str, checker: StopChecker) -> tuple[str, str | None]:
    """Feeds ``text`` token by token the way the engine does; returns (final text, stop string)."""
    detok = IncrementalDetokenizer(tok, [], True)
    output = ""
    for i in output_ids(tok, text):
        delta = detok.step(i)
        output += delta
        match = checker.check(output, delta)
        if match is not None:
            return match.text, match.stop_str
    return output, None


@pytest.mark.parametrize("name", ["bpe", "sp"])
@pytest.mark.parametrize(
    ("text", "stop", "include", "expected", "stop_str"),
    [
        ("STOP and more", ["STOP"], False, "", "STOP"),
        ("STOP and more", ["STOP"], True, "STOP", "STOP"),
        ("hello world STOP the fox", ["STOP"], False, "hello world ", "STOP"),
        ("hello world STOP the fox", ["STOP"], True, "hello world STOP", "STOP"),
        # Stop strings spanning several tokens, including multi-byte chars split into bytes.
        ("the quick brown fox jumps", ["brown fox"], False, "the quick ", "brown fox"),
        ("say 日本語 now", ["本語 n"], False, "say 日", "本語 n"),
        ("crab 🦀🦀 here", ["🦀🦀"], True, "crab 🦀🦀", "🦀🦀"),
        # Earliest match wins regardless of list order.
        ("a fox then a dog", ["dog", "fox"], False, "a ", "fox"),
        ("a fox then a dog", ["dog", "fox"], True, "a fox", "fox"),
        ("no stop here", ["xyz"], False, "no stop here", None),
    ],
)
def test_stop_strings_streamed(name, text, stop, include, expected, stop_str, request) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    checker = StopChecker(tuple(stop), include_stop_str_in_output=include)
    assert stream_until_stop(tok, text, checker) == (expected, stop_str)


def test_earliest_stop_wins_within_one_delta() -> None:
    checker = StopChecker(("cd", "bcde", "b"))
    match = checker.check("abcdef", "abcdef")
    assert match is not None and (match.stop_str, match.text) == ("b", "a")
    # On the same start, the shorter string completed first.
    assert StopChecker(("bcd", "bc"), True).check("abcdef", "abcdef").text == "abc"


def test_stop_search_only_covers_new_text() -> None:
    checker = StopChecker(("STOP",))
    # The old "STOP" lies wholly before the region a new match could occupy.
    assert checker.check("xxSTOPyyyy", "y") is None
    # A match ending in the delta is found even though it starts len(stop)-1 chars earlier.
    match = checker.check("xxSTOP", "P")
    assert match is not None and match.text == "xx"
    assert checker.check("xxSTOP", "") is None
    assert checker.hold_back_chars == 3


def test_find_stop_whole_text() -> None:
    assert find_stop("one two three", ["three", "two"]) == ("one ", "two")
    assert find_stop("one two three", ["two"], include_stop_str_in_output=True) == ("one two", "two")
    assert find_stop("one two three", ["four"]) is None
    assert find_stop("one two three", ["one"], new_chars=3) is None


def test_stop_checker_validation() -> None:
    assert StopChecker("END").stop == ("END",)
    with pytest.raises(ValueError):
        StopChecker(("ok", ""))
