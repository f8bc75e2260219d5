"""OpenAI's request fields, checked and turned into the engine's `SamplingParams`, and OpenAI's
error body. Fields outside OpenAI's schema that vLLM accepts at the top level (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `structured_outputs`, ...) are read the same way. An invalid
value is a 400 whose message names the field, and so is a field this server does not serve
(`suffix`, `functions`) or does not know (`known_fields`: a misspelt or another server's field
is refused rather than answered as if it were not there)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from compiled.runtime.sampling_params import SamplingParams
from compiled.structured.spec import StructuredOutputs


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                             409: "ConflictError", 503: "ServiceUnavailableError"}.get(status, "InternalServerError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


# field -> (type check, SamplingParams field)
_NUMBERS = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty"}
_INTS = {"top_k": "top_k", "seed": "seed", "min_tokens": "min_new_tokens"}
# SamplingParams field -> the request field that sets it, where the names differ
_REQUEST_FIELD = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


@dataclass
class Sampling:
    """The request's choices: `n` sampling params (seed + i per choice when seeded), whether it
    streams, and how many top logprobs each token reports (None: no logprobs)."""
    params: list[SamplingParams]
    stream: bool
    include_usage: bool
    top_logprobs: int | None
    echo: bool = False      # completions: each choice starts with its prompt (and its logprobs)
    prompt_only: bool = False   # echo with max_tokens 0: the prompt is the whole choice


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"expected a number, got {value!r}")
    return float(value)


def _int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"expected an integer, got {value!r}")
    return value


# OpenAI's fields that change what a request returns and that this server does not serve, each
# with its no-op values: set to anything else it is a 400 naming it, not an answer made without it.
_UNSERVED = {"suffix": ("",), "functions": ([],), "function_call": ("none", "auto"), "prediction": (),
             "audio": (), "modalities": (["text"],), "web_search_options": ()}

# Every field a request may carry: OpenAI's (those in `_UNSERVED` with their no-op values only;
# `user`, `metadata`, `store`, `service_tier` and the like change nothing here) and vLLM's read here.
_COMMON = {"model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "seed", "stop",
           "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "response_format",
           "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
           "include_stop_str_in_output", "stop_token_ids", "structured_outputs", "echo",
           "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"}
_KNOWN = {
    False: _COMMON | {"prompt", "best_of", "suffix"},
    True: _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                     "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort", "verbosity",
                     "functions", "function_call", "prediction", "audio", "modalities", "web_search_options"},
}
# Fields other servers read, with what serves them here.
_INSTEAD = {"guided_json": "structured_outputs.json", "guided_regex": "structured_outputs.regex",
            "guided_choice": "structured_outputs.choice", "guided_grammar": "structured_outputs.grammar",
            "guided_decoding_backend": "nothing (xgrammar is the only backend)"}


def known_fields(body: dict, chat: bool) -> None:
    """A 400 naming the request's fields this server does not read (vLLM logs and ignores them:
    a request answered as if a misspelt constraint were not there returns output unchecked)."""
    unknown = sorted(set(body) - _KNOWN[chat])
    if unknown:
        hint = "; ".join(f"{f}: use {_INSTEAD[f]}" for f in unknown if f in _INSTEAD)
        raise bad(unknown[0], f"unknown field(s) {', '.join(unknown)} for "
                  f"{'chat completions' if chat else 'completions'}" + (f" ({hint})" if hint else ""))


def check_served(body: dict, n: int, chat: bool) -> None:
    """A 400 for a field in `_UNSERVED` set to more than a no-op value, a `best_of` other than `n`
    (the best `n` of more choices is not served) or a chat's `echo`."""
    if chat and body.get("echo") not in (None, False):
        raise bad("echo", "not supported for chat completions")
    for name, noops in _UNSERVED.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in noops):
            raise bad(name, f"not supported by this server (got {value!r})")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad("best_of", f"only best_of = n ({n}) is served, got {best_of!r}")


def sampling(body: dict, prompt_len: int, context: int, chat: bool,
             structured: StructuredOutputs | None = None) -> Sampling:
    """The request's sampling, checked against the context: a prompt plus `max_tokens` beyond it
    is a 400 naming max_tokens (not a silent cut); no `max_tokens`: up to the context.
    `structured`: what every choice's output must match."""
    room = context - prompt_len
    if room <= 0:
        raise bad("prompt" if not chat else "messages", f"{prompt_len} tokens leave no room in the context of "
                  f"{context} tokens")
    max_tokens = _int(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens")
    # echo with max_tokens 0 (as vLLM serves it): the prompt alone, with its logprobs if asked (a
    # likelihood query); the engine still makes one token, which is dropped.
    prompt_only = not chat and max_tokens == 0 and body.get("echo") is True
    if max_tokens is None:
        max_tokens = room
    elif prompt_only:
        max_tokens = 1
    elif max_tokens < 1:
        raise bad("max_tokens", f"expected an integer >= 1 (0 only with echo), got {max_tokens}")
    elif max_tokens > room:
        raise bad("max_tokens", f"{max_tokens} tokens after a prompt of {prompt_len} exceed the context of "
                  f"{context} tokens (at most {room})")
    n = _int(body, "n")
    n = 1 if n is None else n
    if n < 1:
        raise bad("n", f"expected an integer >= 1, got {n}")
    check_served(body, n, chat)
    kwargs: dict = {"max_new_tokens": max_tokens, "structured_outputs": structured}
    for name, field_name in _NUMBERS.items():
        if (v := _number(body, name)) is not None:
            kwargs[field_name] = v
    for name, field_name in _INTS.items():
        if (v := _int(body, name)) is not None:
            kwargs[field_name] = v
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("stop", f"expected a string or a list of strings, got {body.get('stop')!r}")
        kwargs["stop"] = stop
    bias = body.get("logit_bias")
    if bias is not None:   # JSON object keys are strings: token ids as text
        if not isinstance(bias, dict) or not all(isinstance(t, str) and t.isdigit() for t in bias):
            raise bad("logit_bias", f"expected an object of token ids to numbers, got {bias!r}")
        kwargs["logit_bias"] = {int(t): b for t, b in bias.items()}
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise bad("stop_token_ids", f"expected a list of integers, got {stop_ids!r}")
        kwargs["stop_token_ids"] = stop_ids
    for flag in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        value = body.get(flag)
        if value is not None:
            if not isinstance(value, bool):
                raise bad(flag, f"expected true or false, got {value!r}")
            kwargs[flag] = value
    top_logprobs = _logprobs(body, chat)
    if top_logprobs is not None:
        kwargs["logprobs"] = top_logprobs
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise bad("echo", f"expected true or false, got {echo!r}")
    if echo and top_logprobs is not None:
        kwargs["prompt_logprobs"] = top_logprobs
    stream, include_usage = _streaming(body)
    params = []
    for i in range(n):
        choice = dict(kwargs)
        if "seed" in choice:
            choice["seed"] = kwargs["seed"] + i
        try:
            params.append(SamplingParams(**choice))
        except (ValueError, TypeError) as e:   # SamplingParams names its own field: give the request's
            field = re.match(r"SamplingParams\.(\w+)", str(e))
            raise APIError(400, str(e), _REQUEST_FIELD.get(field[1], field[1]) if field else None) from None
    return Sampling(params, stream, include_usage, top_logprobs, echo, prompt_only)


def _streaming(body: dict) -> tuple[bool, bool]:
    """Whether the request streams, and whether its stream ends with the usage."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"expected true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", f"expected an object, got {options!r}")
    return stream, bool(options.get("include_usage"))


def _logprobs(body: dict, chat: bool) -> int | None:
    """Completions: `logprobs` is the count; chat: `logprobs: true` with `top_logprobs`."""
    if chat:
        wanted = body.get("logprobs")
        if wanted is None or wanted is False:
            return None
        if wanted is not True:
            raise bad("logprobs", f"expected true or false, got {wanted!r}")
        top = _int(body, "top_logprobs")
        top = 0 if top is None else top
        if not 0 <= top <= 20:
            raise bad("top_logprobs", f"expected an integer in [0, 20], got {top}")
        return top
    count = _int(body, "logprobs")
    if count is not None and not 0 <= count <= 20:
        raise bad("logprobs", f"expected an integer in [0, 20], got {count}")
    return count
