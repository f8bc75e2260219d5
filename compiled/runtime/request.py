"""A request's state while it is served, and what the user gets back."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import numpy as np
import torch

from compiled.errors import RequestError
from compiled.runtime.sampling_params import SamplingParams

Logprobs = dict[int, float]


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None          # "stop" (EOS, stop token or stop string), "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = 0   # prompt tokens its first admission found in the prefix cache (as vLLM's)
    error: str | None = None     # why it ended early (finish_reason "abort"), e.g. its grammar did not compile


@dataclass
class Request:
    id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0               # tokens whose K/V are in the cache
    row: int | None = None              # row of the request->token table while admitted
    lora: str | None = None             # the adapter it runs with (None: the base model)
    lora_slot: int = -1                 # that adapter's GPU slot while admitted
    prefix: object | None = None        # its cached prefix (prefix_cache.Prefix) while admitted
    cp_synced: int = 0                  # positions [0, cp_synced) have their K/V on every context-parallel rank
    slots: list = field(default_factory=list)  # numpy arrays of the KV slots owned, freed on finish
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    detokenizer: object | None = None
    stops: object | None = None         # its StopChecker, with a detokenizer and stop strings
    pending: int = 0                    # tokens sampled on the device, not yet read back (overlap)
    first_launched: float | None = None  # time.perf_counter() when a step first computed its tokens
    num_cached_tokens: int | None = None  # prompt tokens its first admission found cached (None: not yet admitted)
    grammar: object | None = None       # its structured.matcher.RequestGrammar, with structured_outputs
    error: str | None = None            # why it ended without finishing (finish_reason "abort")

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence.
        Pending tokens read as 0: the runner writes their real values on the device."""
        known = self.num_resolved
        if end > known:
            return self.token_ids(min(start, known), known) + [0] * (end - max(start, known))
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        """Prompt + output, counting the pending tokens (what the scheduler places in the KV cache)."""
        return self.num_resolved + self.pending

    @property
    def num_resolved(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.output_token_ids), text=self.text, finish_reason=self.finish_reason,
            stop_reason=self.stop_reason, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens or 0, error=self.error,
        )


def check_logit_bias(index: int, params: SamplingParams, vocab: int) -> None:
    """Prompt `index`'s `logit_bias` names tokens of the vocabulary only (its values were checked
    with the params)."""
    if params.logit_bias and max(params.logit_bias) >= vocab:
        raise RequestError(f"sampling params of prompt {index}: logit_bias names token {max(params.logit_bias)}, "
                           f"outside the vocabulary of {vocab}")


def check_token_ids(index: int, prompt, vocab: int) -> list[int]:
    """Prompt `index`'s ids as Python ints; numpy / torch integer ids are accepted as the ints they
    hold, while bools (an int subclass) and anything else are refused."""
    if type(prompt) is list and all(type(t) is int for t in prompt) \
            and (not prompt or (min(prompt) >= 0 and max(prompt) < vocab)):
        # the common case, in builtins (50 µs for 1,064 ids, 620 below): a server's handler
        # holds the GIL here
        return list(prompt)
    ids = []
    for t in prompt:
        if isinstance(t, (np.ndarray, torch.Tensor)) and t.ndim == 0:
            t = t.item()
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise RequestError(f"prompt {index} has token id {t!r} of type {type(t).__name__}: "
                               f"expected ints in [0, {vocab})")
        t = int(t)
        if not 0 <= t < vocab:
            raise RequestError(f"prompt {index} has token id {t} outside the vocabulary [0, {vocab})")
        ids.append(t)
    return ids
