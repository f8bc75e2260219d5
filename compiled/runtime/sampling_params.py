"""Per-request sampling settings, modelled on vLLM's `SamplingParams`.

Every field is validated at construction and again (`validate`) when a request
is made from the params, so a field set after construction is checked too; the
sampler and the engine then trust every field without re-checking it on the
hot path."""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any

from compiled.structured.spec import StructuredOutputs

# torch.Generator.manual_seed accepts exactly this range; checking it here turns
# a late, cryptic overflow inside the engine into an error naming the field.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


def _fail(name: str, requirement: str, value: Any) -> ValueError:
    # repr() keeps strings quoted; replacing newlines keeps the message one line
    # even for values whose repr spans several lines.
    shown = repr(value).replace("\n", " ")
    return ValueError(f"SamplingParams.{name} {requirement}, got {shown}")


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but `max_new_tokens=True` is always a mistake.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise _fail(name, "must be an int", value)
    return int(value)


def _check_float(name: str, value: Any) -> float:
    if not _is_real(value):
        raise _fail(name, "must be a float", value)
    value = float(value)
    if math.isnan(value):
        raise _fail(name, "must not be NaN", value)
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, "must be a bool", value)
    return value


def _check_top_n(name: str, value: Any) -> int | None:
    """`logprobs` / `prompt_logprobs`: None, -1 (whole vocabulary) or a count."""
    if value is None:
        return None
    if not _is_int(value) or value < -1:
        raise _fail(name, "must be None, -1 (whole vocab) or an int >= 0", value)
    return int(value)


def _normalise_stop(value: Any) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise _fail("stop", "must be a str, a list of str, or None", value)
    if any(s == "" for s in items):
        raise _fail("stop", "must not contain empty strings", value)
    return list(items)


def _normalise_stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in value):
        raise _fail("stop_token_ids", "must be None or a list of ints >= 0", value)
    return [int(t) for t in value]


# OpenAI's range for a logit bias: -100 bans a token, +100 all but forces it.
LOGIT_BIAS_MAX = 100.0


def _normalise_logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(_is_int(t) and t >= 0 for t in value):
        raise _fail("logit_bias", "must be None or a dict of token ids (ints >= 0) to biases", value)
    if not all(_is_real(b) and -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX for b in value.values()):   # NaN fails too
        raise _fail("logit_bias", f"values must be numbers in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]", value)
    return {int(t): float(b) for t, b in value.items()} or None


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Defaults match vLLM's where they exist."""

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # added to a token's logit before it is chosen
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token; -1 = whole vocab
    prompt_logprobs: int | None = None  # the same, for every prompt position
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # The output must match a JSON schema, regex, choice or grammar (a dict of its fields is taken)
    structured_outputs: StructuredOutputs | dict | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field and normalise it in place (numpy numbers to Python ones, `stop` to a
        list); a bad field is a ValueError naming it, its value and the allowed range."""
        self._validate_lengths()
        self._validate_sampling()
        self._validate_penalties()
        self._validate_output_options()

    def _validate_lengths(self) -> None:
        self.max_new_tokens = _check_int("max_new_tokens", self.max_new_tokens)
        if self.max_new_tokens < 1:
            raise _fail("max_new_tokens", "must be >= 1", self.max_new_tokens)
        self.min_new_tokens = _check_int("min_new_tokens", self.min_new_tokens)
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise _fail(
                "min_new_tokens",
                f"must be in [0, max_new_tokens={self.max_new_tokens}]",
                self.min_new_tokens,
            )

    def _validate_sampling(self) -> None:
        self.temperature = _check_float("temperature", self.temperature)
        if not (0.0 <= self.temperature < math.inf):
            raise _fail("temperature", "must be finite and >= 0 (0 means greedy)", self.temperature)
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise _fail("top_k", "must be -1 or 0 (off) or >= 1", self.top_k)
        self.top_p = _check_float("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):
            raise _fail("top_p", "must be in (0, 1]", self.top_p)
        self.min_p = _check_float("min_p", self.min_p)
        if not (0.0 <= self.min_p <= 1.0):
            raise _fail("min_p", "must be in [0, 1]", self.min_p)
        if self.seed is not None:
            if not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX:
                raise _fail("seed", f"must be None or an int in [{_SEED_MIN}, {_SEED_MAX}]", self.seed)
            self.seed = int(self.seed)

    def _validate_penalties(self) -> None:
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if not (0.0 < self.repetition_penalty < math.inf):
            raise _fail("repetition_penalty", "must be finite and > 0", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not (-2.0 <= value <= 2.0):
                raise _fail(name, "must be in [-2, 2]", value)
            setattr(self, name, value)
        self.logit_bias = _normalise_logit_bias(self.logit_bias)

    def _validate_output_options(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self.logprobs = _check_top_n("logprobs", self.logprobs)
        self.prompt_logprobs = _check_top_n("prompt_logprobs", self.prompt_logprobs)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))
        self.structured_outputs = StructuredOutputs.from_value(self.structured_outputs)

    @property
    def max_tokens(self) -> int:
        """vLLM's name for `max_new_tokens`: one setting, read or written under either name."""
        return self.max_new_tokens

    @max_tokens.setter
    def max_tokens(self, value: int) -> None:
        self.max_new_tokens = value

    @property
    def has_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def has_presence_frequency_penalty(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        """True when the choice is deterministic: argmax of the penalised logits."""
        return self.temperature == 0.0 or self.top_k == 1


_UNSET = object()


def _accept_max_tokens(init):
    """The dataclass __init__, also taking vLLM's `max_tokens=` for `max_new_tokens`."""
    @functools.wraps(init)
    def __init__(self, *args, max_tokens: Any = _UNSET, **kwargs) -> None:
        if max_tokens is not _UNSET:
            if args or ("max_new_tokens" in kwargs and kwargs["max_new_tokens"] != max_tokens):
                given = args[0] if args else kwargs["max_new_tokens"]
                raise ValueError(f"SamplingParams got max_tokens={max_tokens!r} and max_new_tokens={given!r}: "
                                 "they are one setting (max_tokens is vLLM's name), pass one of them")
            kwargs["max_new_tokens"] = max_tokens
        init(self, *args, **kwargs)
    return __init__


SamplingParams.__init__ = _accept_max_tokens(SamplingParams.__init__)
