"""What the HTTP routes share (`Server`, the app's state): the served model and the engine's
process, the checks that turn a request body into engine requests, and the pieces of OpenAI's
response bodies every route builds the same way (logprobs entries, usage)."""

from __future__ import annotations

import asyncio
import time

import jinja2

from compiled.errors import RequestError
from compiled.runtime.request import check_logit_bias, check_token_ids
from compiled.runtime.tokenizer import Tokenizer, load_tokenizer
from compiled.server.chat_messages import chat_messages
from compiled.server.chat_output import ChatOptions
from compiled.server.engine_process import EngineClient
from compiled.server.messages import ModelInfo, Submitted
from compiled.server.protocol import APIError, Sampling, bad


class Server:
    """The app's state: the engine's process, the served model, its tokenizer and adapters."""

    def __init__(self, engine: EngineClient, info: ModelInfo, served_name: str, max_queued: int | None,
                 chat: ChatOptions | None = None) -> None:
        self.engine, self.info = engine, info
        self.chat = chat or ChatOptions()   # how chat outputs are read: tool calls, reasoning
        self.tokenizer: Tokenizer | None = load_tokenizer(info.tokenizer_path) if info.tokenizer_path else None
        self.loras = list(info.loras)   # the adapters served, as loaded and unloaded through this server
        self.served_name, self.max_queued = served_name, max_queued
        self.created = int(time.time())

    # ---- helpers ----------------------------------------------------------------------------

    def adapter_of(self, body: dict) -> str | None:
        name = body.get("model") or self.served_name
        if name == self.served_name:
            return None
        if name in self.loras:
            return name
        raise APIError(404, f"model: {name!r} is neither the served model ({self.served_name!r}) nor a loaded "
                       "adapter", "model")

    def prompts_of(self, body: dict) -> list[list[int]]:
        prompt = body.get("prompt")
        tok = self.tokenizer
        if isinstance(prompt, str):
            prompt = [prompt]
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):   # bools are not ids
            return [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(type(t) is int for t in p)
                                                         for p in prompt):
            return prompt   # several prompts of token ids
        if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) and p for p in prompt):
            raise bad("prompt", "expected a non-empty string, a list of strings, a list of token ids or a list of "
                      "lists of them")
        if tok is None:
            raise bad("prompt", "the model has no tokenizer: send token ids")
        return [tok.encode(p) for p in prompt]

    def prompt_texts(self, body: dict, prompts: list[list[int]]) -> list[str]:
        """Each completions prompt as text (what `echo` puts in front): as sent, or its token ids
        decoded."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        return [self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""
                for ids in prompts]

    def chat_prompt(self, body: dict, tools: list[dict] | None = None) -> list[int]:
        """The chat's prompt ids: its messages (and `tools`, when given) through the chat
        template, with the request's `chat_template_kwargs` (vLLM's; e.g. Qwen3's
        `enable_thinking`) as template variables."""
        messages = chat_messages(body.get("messages"))
        template_kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(template_kwargs, dict):
            raise bad("chat_template_kwargs", f"expected an object, got {template_kwargs!r}")
        if self.tokenizer is None:
            raise bad("messages", "the model has no tokenizer, so no chat template")
        if tools:
            template_kwargs = {**template_kwargs, "tools": tools}
        try:
            text = self.tokenizer.apply_chat_template(messages, **template_kwargs)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise bad("messages", f"the chat template failed: {e}") from None
        return self.tokenizer.encode(text)

    def start(self, prompts: list[list[int]], s: Sampling,
              adapter: str | None) -> tuple[list[Submitted], asyncio.Queue]:
        """Engine requests for every (prompt, choice); the queue of their reports."""
        posted = time.perf_counter()
        if not self.engine.alive:
            raise APIError(503, "the engine has stopped")
        if self.max_queued is not None and self.engine.waiting() >= self.max_queued:
            raise APIError(503, f"the queue is full ({self.max_queued} requests wait: --max-queued-requests)")
        try:   # the same for every choice
            check_logit_bias(0, s.params[0], self.info.vocab_size)
        except RequestError as e:
            raise APIError(400, str(e), "logit_bias") from None
        requests = []
        try:
            for i, ids in enumerate(prompts):
                ids = check_token_ids(i, ids, self.info.vocab_size)
                for params in s.params:   # each checked when `sampling` made it
                    requests.append(Submitted(self.engine.new_key(), ids, params, adapter))
        except (RequestError, ValueError) as e:
            raise APIError(400, str(e), "prompt") from None
        return requests, self.engine.submit(requests, posted)

    def token_text(self, token: int) -> str:
        tok = self.tokenizer
        return tok.decode([token], skip_special_tokens=False) if tok is not None else str(token)

    def usage(self, requests: list[Submitted], n: int, completion_tokens: int, cached: list[int | None]) -> dict:
        """OpenAI's usage: each prompt counted once, however many choices it has (`n`), and of its
        tokens those the prefix cache held (`cached`: each request's, from its first report)."""
        prompt = sum(len(r.prompt_token_ids) for r in requests[::n])
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(c or 0 for c in cached[::n])}}

    def logprobs_entry(self, tokens: list[int], logprobs: list[dict[int, float]], k: int, chat: bool) -> list:
        entries = []
        for t, lp in zip(tokens, logprobs):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
            if chat:
                entries.append({"token": self.token_text(t), "logprob": lp[t], "bytes": None,
                                "top_logprobs": [{"token": self.token_text(i), "logprob": v, "bytes": None}
                                                 for i, v in top]})
            else:
                entries.append((self.token_text(t), lp[t], {self.token_text(i): v for i, v in top}))
        return entries

