"""Loads a checkpoint's tokenizer and exposes the small surface the runtime needs.

Two on-disk formats are supported, both fully offline:

* ``tokenizer.json`` (or ``vocab.json`` + ``merges.txt``): loaded by
  ``transformers.AutoTokenizer`` into a Rust-backed fast tokenizer. This is what
  every Qwen3 checkpoint ships.
* a bare sentencepiece ``tokenizer.model``: transformers 5 converts it to a fast
  tokenizer by parsing the model proto, which needs ``protobuf`` (not a dependency
  of this project); without it ``AutoTokenizer`` falls through to a tiktoken reader
  and fails for e.g. ``LlamaTokenizer``. Only classes built on ``SentencePieceBackend``
  (e.g. ``GPTSw3Tokenizer``) load without protobuf, so a checkpoint naming one gets it;
  any other goes to :class:`SentencePieceTokenizer`, a thin ``SentencePieceBackend``
  subclass that lets the ``sentencepiece`` library itself encode and decode, so the
  ids are exactly sentencepiece's own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import sentencepiece as spm
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

from compiled.errors import ConfigError
from compiled.json_file import read_json_object

__all__ = ["SentencePieceTokenizer", "Tokenizer", "has_tokenizer", "load_tokenizer"]

_SPM_FILE = "tokenizer.model"
# The JSON files transformers may read from a tokenizer folder; each holds one JSON object.
_JSON_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
               "chat_template.json", "vocab.json")


def _has_fast_files(folder: Path) -> bool:
    if (folder / "tokenizer.json").is_file():
        return True
    # GPT-2 style checkpoints without a tokenizer.json are still buildable by transformers.
    return (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()


def has_tokenizer(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a folder that :func:`load_tokenizer` can load."""
    folder = Path(path)
    return folder.is_dir() and (_has_fast_files(folder) or (folder / _SPM_FILE).is_file())


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Loads the tokenizer stored in the checkpoint folder ``path`` without touching the network."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"tokenizer folder {str(folder)!r} does not exist or is not a directory")
    fast = _has_fast_files(folder)
    if not fast and not (folder / _SPM_FILE).is_file():
        raise ValueError(
            f"no tokenizer files in {str(folder)!r} "
            "(expected tokenizer.json, tokenizer.model, or vocab.json + merges.txt)"
        )
    try:
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True) if fast else _load_sentencepiece(folder)
    except ConfigError:
        raise
    except Exception as e:
        # transformers reports a broken file as a bare JSONDecodeError, KeyError or TypeError that
        # names no file; find the file at fault so the one-line error can name it.
        raise _culprit(folder, folder if fast else folder / _SPM_FILE, e) from e
    return Tokenizer(hf)


def _culprit(folder: Path, main_file: Path, error: Exception) -> ConfigError:
    """The error naming the tokenizer file that made loading fail: the first malformed JSON file,
    else `main_file` (the folder, or the sentencepiece model) with the loader's own message."""
    for name in _JSON_FILES:
        if (folder / name).is_file():
            try:
                read_json_object(folder / name)
            except ConfigError as e:
                return e
    first = str(error).splitlines()[0] if str(error) else ""
    return ConfigError(f"{main_file}: cannot load the tokenizer ({type(error).__name__}: {first})")


def _configured_class(folder: Path) -> type | None:
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    name = read_json_object(config_file).get("tokenizer_class")
    return tokenizer_class_from_name(name) if isinstance(name, str) else None


def _load_sentencepiece(folder: Path) -> PreTrainedTokenizerBase:
    named = _configured_class(folder)
    if named is not None and issubclass(named, SentencePieceBackend):
        # The checkpoint's own class needs no protobuf, so honour its pre-processing quirks.
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return SentencePieceTokenizer.from_pretrained(str(folder), local_files_only=True)


class Tokenizer:
    """The runtime's view of a HF tokenizer; ``hf`` is the wrapped object for anything else."""

    def __init__(self, hf: PreTrainedTokenizerBase) -> None:
        self.hf = hf
        # all_special_ids is recomputed by HF on every access; the detokenizer asks often.
        self._all_special_ids: list[int] = list(hf.all_special_ids)

    def encode(self, text: str) -> list[int]:
        # Like vLLM: the model's own prompt specials (e.g. a BOS) are added, nothing else.
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of tokenization spaces: it is not prefix-stable, so incremental
        # decoding could not reproduce it (vLLM's streamed text never applies it either).
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def convert_ids_to_tokens(self, ids: Sequence[int], skip_special_tokens: bool = False) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        return self.hf.convert_tokens_to_string(list(tokens))

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._all_special_ids)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce or decode, added tokens included.

        The model's embedding table may be larger (padded); this is the bound for
        validating user-supplied token ids, not the logits width."""
        return len(self.hf)

    def apply_chat_template(self, text: str | list[dict], **template_kwargs: Any) -> str:
        """Renders ``text`` as a single user turn (or a list of ``{"role", "content"}`` messages as
        the conversation) followed by the assistant prompt.

        ``template_kwargs`` reach the template as variables (e.g. ``enable_thinking=False``)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(
                f"tokenizer from {self.hf.name_or_path!r} has no chat template; pass a raw prompt instead"
            )
        rendered = self.hf.apply_chat_template(
            [{"role": "user", "content": text}] if isinstance(text, str) else text,
            add_generation_prompt=True,
            tokenize=False,
            **template_kwargs,
        )
        assert isinstance(rendered, str)
        return rendered

    def __len__(self) -> int:
        return len(self.hf)

    def __repr__(self) -> str:
        return f"Tokenizer({type(self.hf).__name__}, name={self.hf.name_or_path!r}, vocab={len(self.hf)})"


# --- sentencepiece-backed tokenizer (no protobuf needed) -----------------------------------------

# (add_bos, add_eos) -> how PreTrainedTokenizer.build_inputs_with_special_tokens wraps a prompt.
_SPECIAL_TOKENS_PATTERN = {
    (False, False): "none",
    (True, False): "bos",
    (False, True): "eos",
    (True, True): "bos_eos",
}


def _spm_special_token_defaults(vocab_file: str) -> dict[str, str]:
    """bos/eos/unk/pad pieces as declared inside the .model, for configs that omit them."""
    sp = spm.SentencePieceProcessor(model_file=vocab_file)
    ids = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "unk_token": sp.unk_id(), "pad_token": sp.pad_id()}
    return {name: sp.id_to_piece(i) for name, i in ids.items() if i >= 0}


class SentencePieceTokenizer(SentencePieceBackend):
    """A tokenizer for folders that only ship a sentencepiece ``tokenizer.model``.

    ``SentencePieceBackend`` alone is not usable as-is: it decodes byte-fallback
    pieces as literal ``<0xE6>`` text, strips spaces, and never adds a BOS. This
    subclass decodes through sentencepiece and adds BOS/EOS per ``add_bos_token`` /
    ``add_eos_token`` (defaulting, like Llama, to a BOS when the model has one).

    Text after a special token is segmented by sentencepiece as a fresh sentence
    (HF's ``legacy=True`` behaviour); ``legacy=False`` would need protobuf to switch off
    the model's dummy prefix, so it is ignored.
    """

    def __init__(
        self,
        vocab_file: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool = False,
        **kwargs: Any,
    ) -> None:
        if vocab_file is None:
            raise ValueError(f"SentencePieceTokenizer needs a {_SPM_FILE}")
        for name, piece in _spm_special_token_defaults(vocab_file).items():
            kwargs.setdefault(name, piece)
        if add_bos_token is None:
            add_bos_token = kwargs.get("bos_token") is not None
        kwargs["special_tokens_pattern"] = _SPECIAL_TOKENS_PATTERN[(bool(add_bos_token), bool(add_eos_token))]
        # legacy=False makes the parent import protobuf; see the class docstring.
        kwargs["legacy"] = True
        super().__init__(vocab_file=vocab_file, **kwargs)
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)

    def _is_literal(self, token_id: int, special_ids: set[int]) -> bool:
        """Ids sentencepiece cannot render: added tokens, and specials (control pieces decode to "")."""
        return token_id in special_ids or token_id in self._added_tokens_decoder or token_id >= self.vocab_size

    def _decode(
        self,
        token_ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **kwargs: Any,
    ) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        special_ids = set(self.all_special_ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in special_ids]
        # sentencepiece joins byte-fallback pieces into UTF-8 only within one decode call,
        # so ordinary ids are decoded in maximal runs between literal tokens.
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if self._is_literal(i, special_ids):
                if run:
                    parts.append(self.sp_model.decode(run))
                    run = []
                parts.append(self.convert_ids_to_tokens(i))
            else:
                run.append(i)
        if run:
            parts.append(self.sp_model.decode(run))
        text = "".join(parts)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        if clean_up_tokenization_spaces:
            text = self.clean_up_tokenization(text)
        return text

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self._decode(self.convert_tokens_to_ids(list(tokens)), clean_up_tokenization_spaces=False)
