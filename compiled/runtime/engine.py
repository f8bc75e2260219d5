"""The engine loop: schedule a batch, run the model, sample, detokenize, check stops.

One `step()` is one forward pass. Requests stay queued until they finish; bad requests are
rejected before anything is queued, so a call with one bad prompt loses nothing that runs."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from compiled.attention.kv_cache import KVPool, ReqToTokenPool
from compiled.errors import RequestError
from compiled.graphs.config import ModelConfig
from compiled.runtime.config import EngineConfig
from compiled.runtime.detokenizer import IncrementalDetokenizer, find_stop
from compiled.runtime.model_runner import ModelRunner
from compiled.runtime.request import Request
from compiled.runtime.sampler import Sampler, SamplingBatch, batch_top_logprobs
from compiled.runtime.sampling_params import SamplingParams
from compiled.runtime.scheduler import Batch, Scheduler
from compiled.runtime.tokenizer import Tokenizer


class Engine:
    def __init__(self, model: nn.Module, mcfg: ModelConfig, cfg: EngineConfig, num_kv_slots: int,
                 tokenizer: Tokenizer | None, eos_token_ids: set[int]) -> None:
        self.model, self.model_config, self.cfg = model, mcfg, cfg
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self._eos_sorted = sorted(eos_token_ids)
        self.kv = KVPool(mcfg.num_hidden_layers, num_kv_slots, mcfg.num_key_value_heads, mcfg.head_dim,
                         cfg.dtype, cfg.device)
        self.req_pool = ReqToTokenPool(cfg.max_num_seqs, cfg.max_model_len, cfg.device)
        self.scheduler = Scheduler(self.kv, self.req_pool, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.runner = ModelRunner(model, cfg, self.kv, self.req_pool)
        self.sampler = Sampler()
        # A request can never outgrow the context nor the whole KV cache.
        self.max_context = min(cfg.max_model_len, num_kv_slots)
        self._ids = itertools.count()

    def graph_buckets(self) -> list[int]:
        from compiled.runtime.cuda_graphs import DEFAULT_MAX_BATCH, default_buckets
        # A bucket is a batch of one-token requests: it must fit both the request and token limits.
        limit = min(self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens)
        if self.cfg.cuda_graph_buckets is not None:
            return sorted(b for b in self.cfg.cuda_graph_buckets if b <= limit)
        return default_buckets(min(limit, DEFAULT_MAX_BATCH))

    def piecewise_buckets(self) -> list[int]:
        limit = self.cfg.max_num_batched_tokens
        if self.cfg.piecewise_buckets is not None:
            return sorted(b for b in self.cfg.piecewise_buckets if b <= limit)
        top = min(self.cfg.max_piecewise_tokens, limit)
        return [1 << i for i in range(4, top.bit_length()) if 1 << i <= top]

    # ---- admission -------------------------------------------------------------------------

    def make_request(self, index: int, prompt: str | list[int], params: SamplingParams) -> Request:
        """Validate and tokenize one prompt (`index` names it in errors); nothing is queued yet."""
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            if not text:
                raise RequestError(f"prompt {index} is empty")
            if self.tokenizer is None:
                raise RequestError(f"prompt {index} is text but the model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(text)
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"prompt {index} has token id {bad!r} outside the vocabulary [0, {vocab})")
        if not ids:
            raise RequestError(f"prompt {index} is empty")
        if len(ids) >= self.max_context:
            raise RequestError(f"prompt {index} has {len(ids)} tokens; the context holds {self.max_context}")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.cfg.device).manual_seed(params.seed)
        request = Request(id=next(self._ids), prompt=text, prompt_token_ids=ids, params=params, generator=generator)
        if params.logprobs is not None:
            request.logprobs = []
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        return request

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- one step --------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one forward pass; return the requests that finished in it."""
        batch = self.scheduler.schedule()
        if batch is None:
            raise RuntimeError("scheduler found nothing to run although requests are waiting")
        sampling = [(c, row) for c, row in zip(batch.chunks, _last_rows(batch)) if c.samples]
        out = self.runner.forward(batch, [row for _, row in sampling])
        self._prompt_logprobs(batch, out.hidden)
        if not sampling:
            return []
        requests = [c.request for c, _ in sampling]
        sampled = self.sampler(out.logits, SamplingBatch(
            params=[r.params for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            generators=[r.generator for r in requests],
            eos_token_ids=self._eos_sorted,
        ))
        finished = []
        for request, token, logprobs in zip(requests, sampled.token_ids.tolist(), sampled.logprobs):
            self._append(request, token, logprobs)
            if request.finished:
                self.scheduler.finish(request)
                finished.append(request)
        return finished

    def _prompt_logprobs(self, batch: Batch, hidden: torch.Tensor) -> None:
        offset = 0
        for c in batch.chunks:
            request = c.request
            if request.wants_prompt_logprobs:
                # Row p predicts token p + 1; the prompt's last row predicts the first output.
                n = min(c.length, len(request.prompt_token_ids) - 1 - c.start)
                targets = torch.tensor(request.prompt_token_ids[c.start + 1:c.start + 1 + n])
                k = request.params.prompt_logprobs
                for i in range(0, n, self.cfg.logits_chunk):
                    m = min(self.cfg.logits_chunk, n - i)
                    rows = hidden[offset + i:offset + i + m]
                    logprobs = torch.log_softmax(self.runner.logits(rows), dim=-1)
                    request.prompt_logprobs += batch_top_logprobs(logprobs, [k] * m, targets[i:i + m].to(rows.device))
            offset += c.length

    def _append(self, request: Request, token: int, logprobs: dict | None) -> None:
        params = request.params
        request.output_token_ids.append(token)
        if request.logprobs is not None:
            request.logprobs.append(logprobs)
        delta = ""
        if request.detokenizer is not None:
            delta = request.detokenizer.step(token)
            request.text += delta
        n_out = len(request.output_token_ids)
        if n_out >= params.min_new_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                request.finish_reason, request.stop_reason = "stop", token
                return
            if token in params.stop_token_ids:
                request.finish_reason, request.stop_reason = "stop", token
                return
            if params.stop and delta:
                hit = find_stop(request.text, params.stop, params.include_stop_str_in_output, len(delta))
                if hit is not None:
                    request.text, request.stop_reason = hit
                    request.finish_reason = "stop"
                    return
        if n_out >= params.max_new_tokens or request.num_tokens >= self.max_context:
            request.finish_reason = "length"


def _last_rows(batch: Batch) -> list[int]:
    rows, offset = [], 0
    for c in batch.chunks:
        offset += c.length
        rows.append(offset - 1)
    return rows
