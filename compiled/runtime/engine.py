"""The engine loop: schedule a batch, run the model, sample, detokenize, check stops.

One `step()` launches one forward pass. Requests stay queued until they finish; bad requests are
rejected before anything is queued, so a call with one bad prompt loses nothing that runs.

Overlap scheduling (`EngineConfig.overlap_schedule`): when the next step can only be "one more
token for every running request", it is scheduled and launched before the current step's tokens
are read back; its input ids come from the sampler's output on the device. The host then reads
the earlier step's tokens while the GPU runs the later one. A request that a resolved token
finishes (EOS, stop string) has computed one token too many; that token is dropped and its KV
slot freed with the rest. Whatever the rows need that only the host knows (penalties over the
output so far, logprobs, min_new_tokens still to go, a length limit reached at this token, a
request waiting for admission) makes that step synchronous instead."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from compiled.attention.kv_cache import KVPool, ReqToTokenPool
from compiled.compilation.buckets import decode_buckets, token_buckets
from compiled.errors import RequestError
from compiled.graphs.config import ModelConfig
from compiled.runtime.config import EngineConfig
from compiled.runtime.detokenizer import IncrementalDetokenizer, find_stop
from compiled.runtime.inflight import InFlight, TokenReadback
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
        self._readback = TokenReadback(cfg.max_num_seqs, cfg.device)
        self._inflight: InFlight | None = None  # launched, tokens not read yet
        self.num_overlapped = 0  # steps launched before the previous step's tokens were read
        self.overlap_schedule = cfg.overlap_schedule  # may be switched between steps

    def graph_buckets(self) -> list[int]:
        # A bucket is a batch of one-token requests: it must fit both the request and token limits.
        limit = min(self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens)
        if self.cfg.cuda_graph_buckets is not None:
            return sorted(b for b in self.cfg.cuda_graph_buckets if b <= limit)
        return decode_buckets(min(limit, self.cfg.max_cuda_graph_batch))

    def capture_graphs(self) -> dict[str, float]:
        """Capture the decode graphs and, for a compiled model, the pieces' graphs; returns the
        seconds each capture took."""
        seconds = {}
        if self.graph_buckets():
            seconds["capture"] = self.runner.capture_graphs(self.graph_buckets())
        if self.runner.is_compiled and self.piecewise_buckets():
            seconds["capture_piecewise"] = self.runner.capture_piecewise(self.piecewise_buckets())
        return seconds

    def piecewise_buckets(self) -> list[int]:
        limit = self.cfg.max_num_batched_tokens
        if self.cfg.piecewise_buckets is not None:
            return sorted(b for b in self.cfg.piecewise_buckets if b <= limit)
        return token_buckets(min(self.cfg.max_piecewise_tokens, limit))

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
        return self.scheduler.has_work or self._inflight is not None

    # ---- one step --------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Launch one forward pass and read back the tokens of the step before it (or of this
        one, when the next cannot overlap); return the requests that finished."""
        finished: list[Request] = []
        prev, self._inflight = self._inflight, None
        batch = self.scheduler.schedule_decode() if prev is not None and self._can_overlap(prev) else None
        if batch is None:
            if prev is not None:
                finished += self._resolve(prev)
                prev = None
            if not self.scheduler.has_work:
                return finished
            batch = self.scheduler.schedule()
            if batch is None:
                raise RuntimeError("scheduler found nothing to run although requests are waiting")
        launched = self._launch(batch, None if prev is None else prev.token_ids)
        if prev is not None:
            self.num_overlapped += 1
            finished += self._resolve(prev)
        if launched is not None:
            if self._can_overlap(launched):
                self._inflight = launched
            else:
                finished += self._resolve(launched)
        return finished

    def _launch(self, batch: Batch, feed: torch.Tensor | None) -> InFlight | None:
        """Run the model and the sampler on `batch` (input ids of its pending tokens from `feed`)."""
        sampling = [(c, row) for c, row in zip(batch.chunks, _last_rows(batch)) if c.samples]
        out = self.runner.forward(batch, [row for _, row in sampling], feed)
        self._prompt_logprobs(batch, out.hidden)
        if not sampling:
            return None
        requests = [c.request for c, _ in sampling]
        sampled = self.sampler(out.logits, SamplingBatch(
            params=[r.params for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            generators=[r.generator for r in requests],
            eos_token_ids=self._eos_sorted,
        ), argmax=out.argmax)
        for r in requests:
            r.pending += 1
        return self._readback.start(requests, sampled.token_ids, sampled.logprobs)

    def _resolve(self, step: InFlight) -> list[Request]:
        finished = []
        for request, token, logprobs in zip(step.requests, step.tokens(), step.logprobs):
            if request.finished:
                continue  # it finished on an earlier token: this one was computed ahead, dropped
            request.pending -= 1
            self._append(request, token, logprobs)
            if request.finished:
                request.pending = 0
                self.scheduler.finish(request)
                finished.append(request)
        return finished

    def _can_overlap(self, step: InFlight) -> bool:
        """Whether the step after `step` can be launched before its tokens are known: it must be
        one more token for exactly the requests that sampled in `step`, and nothing about it may
        depend on those tokens' values on the host."""
        s = self.scheduler
        if not self.overlap_schedule or (s.waiting and len(s.running) < s.max_num_seqs):
            return False
        if len(step.requests) != len(s.running) or any(a is not b for a, b in zip(step.requests, s.running)):
            return False
        return all(self._token_independent(r) for r in step.requests)

    def _token_independent(self, request: Request) -> bool:
        """The request's next step needs nothing of its pending token but the token itself."""
        p, n_out = request.params, len(request.output_token_ids) + 1  # once the pending one is in
        return (request.pending == 1 and p.logprobs is None and n_out > p.min_new_tokens
                and n_out < p.max_new_tokens and len(request.prompt_token_ids) + n_out < self.max_context
                and not p.has_repetition_penalty and not p.has_presence_frequency_penalty)

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
        if n_out >= params.max_new_tokens or request.num_resolved >= self.max_context:
            request.finish_reason = "length"


def _last_rows(batch: Batch) -> list[int]:
    rows, offset = [], 0
    for c in batch.chunks:
        offset += c.length
        rows.append(offset - 1)
    return rows
