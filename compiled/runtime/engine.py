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
request waiting for admission) makes that step synchronous instead.

A step is a transaction: if it raises (an error, or Ctrl-C while the model runs), the batch it was
launching is rolled back (its KV slots freed, its requests' progress reset, the requests it
admitted queued again), while the work that did complete stands: a step launched before stays
unread and the next call reads it, and requests that finished are returned by the next call.
`abort` ends one request wherever it is; `LLM.generate` aborts its own requests when interrupted."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from compiled.attention.kv_cache import KVPool, ReqToTokenPool
from compiled.compilation.buckets import decode_buckets, eager_buckets, eager_token_buckets, token_buckets
from compiled.errors import RequestError
from compiled.graphs.config import ModelConfig
from compiled.lora.merged import MergedLoRA
from compiled.lora.pool import LoRAPool
from compiled.parallel.tensor import local_kv_heads, shard_plan
from compiled.passes.variant import BASE, LORA, GraphVariant
from compiled.runtime.config import EngineConfig
from compiled.runtime.constrained import Constraints
from compiled.runtime.detokenizer import IncrementalDetokenizer
from compiled.runtime.inflight import InFlight, TokenReadback
from compiled.runtime.model_runner import ModelRunner, StepOutput
from compiled.runtime.request import Logprobs, Request, check_logit_bias, check_token_ids
from compiled.runtime.sampler import Sampler, SamplingBatch, batch_top_logprobs
from compiled.runtime.sampling_params import SamplingParams
from compiled.runtime.scheduler import Batch, Chunk, Scheduler
from compiled.runtime.stop import StopChecker
from compiled.runtime.tokenizer import Tokenizer
from compiled.structured.stats import StructuredStats


class Engine:
    def __init__(self, models: dict[GraphVariant, nn.Module], mcfg: ModelConfig, cfg: EngineConfig,
                 num_kv_slots: int, tokenizer: Tokenizer | None, eos_token_ids: set[int],
                 lora_buffers: nn.Module | None = None, merged: MergedLoRA | None = None) -> None:
        """`models`: the graphs the runner runs, by variant (`build.Models.runner_graphs`)."""
        self.model, self.model_config, self.cfg = models[BASE], mcfg, cfg
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self._eos_sorted = sorted(eos_token_ids)
        self.kv = KVPool(mcfg.num_hidden_layers, num_kv_slots, local_kv_heads(mcfg, cfg.tensor_parallel_size),
                         mcfg.head_dim, cfg.dtype, cfg.device)
        self.req_pool = ReqToTokenPool(cfg.max_num_seqs, cfg.max_model_len, cfg.device)
        self.scheduler = Scheduler(self.kv, self.req_pool, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.enable_prefix_caching, cfg.max_mixed_step_tokens)
        self.runner = ModelRunner(models, cfg, self.kv, self.req_pool)
        if cfg.tp:   # the scheduler's table writes reach the tensor-parallel workers through the runner
            self.scheduler.pointed = self.runner.pointed
        # lora_buffers: the module that names the LoRA buffers (the LoRA graph before compilation).
        self.loras = None if LORA not in models else LoRAPool(lora_buffers or models[LORA], mcfg, cfg.max_lora_rank,
                                                              cfg.max_loaded_loras)
        self.scheduler.admit = self._admit
        if merged is not None:   # merges the pool's adapters into the weights (lora/merged.py)
            merged.adapters = self.loras.adapters
            self.runner.merged = merged
        self.sampler = Sampler()
        # Requests with structured_outputs: their grammars, compiled on background threads, and masks.
        self.constraints = Constraints(tokenizer.hf if tokenizer is not None else None, mcfg.vocab_size,
                                       eos_token_ids, cfg.max_num_seqs, torch.device(cfg.device))
        # A request can never outgrow the context nor the whole KV cache.
        self.max_context = min(cfg.max_model_len, num_kv_slots)
        self._ids = itertools.count()
        self._readback = TokenReadback(cfg.max_num_seqs, cfg.device)
        self._unread: deque[InFlight] = deque()  # launched steps whose tokens are not read yet, oldest first
        self._live: dict[int, Request] = {}  # added and not finished, by id
        self._finished: list[Request] = []  # finished since the last `step` returned
        self.num_overlapped = 0  # steps launched before the previous step's tokens were read
        self._draining: str | None = None   # the adapter admitting no requests this step (_acquire_adapter)
        self._held_for_copy: set[int] = set()   # slots whose copy held a request back in the last pass
        self._claimed: set[str] = set()   # adapters given a slot in this scheduling pass (_acquire_adapter)
        self.overlap_schedule = cfg.overlap_schedule  # may be switched between steps

    def enable_tp(self, group) -> None:
        """Run every step on every rank of tensor-parallel `group` (a `parallel.group.CPGroup`),
        each serving its share of the adapters."""
        self.runner.enable_tp(group)
        if self.loras is not None:
            self.loras.shard_for(shard_plan(self.model_config, group.world, group.rank,
                                            self.cfg.enable_expert_parallel))

    # ---- adapters ------------------------------------------------------------------------------

    def live_requests(self) -> list[Request]:
        """The requests added and not finished (queued or running)."""
        return list(self._live.values())

    def adapters_in_use(self) -> set[str]:
        """The adapters of the requests that are running or queued."""
        return {r.lora for r in self._live.values() if r.lora is not None}

    def _admit(self, request: Request) -> bool:
        """Whether a queued request may start: its grammar compiled (a failed one is ended by the
        next step) and its adapter in a slot."""
        if request.grammar is not None and (not request.grammar.ready or request.grammar.error is not None):
            return False
        return self.loras is None or self._acquire_adapter(request)

    def _acquire_adapter(self, request: Request) -> bool:
        """Give `request` its adapter's slot, starting the copy of the adapter if needed; False
        while the copy has not landed, or when every slot holds an adapter that a running request
        uses (the request waits; requests behind it whose adapters have slots go ahead). So that
        those never keep it waiting, the first such request of a step picks the slot whose
        running requests end first (`_draining`): no request is admitted to it until it is free,
        and then it is this request's (the oldest to wait for a slot). A slot given to a request
        earlier in the queue stays its own for the rest of the pass (`_claimed`), even once its
        copy has landed: taken by a later request, the two would copy their adapters over each
        other's for ever."""
        if request.lora is None:
            request.lora_slot = -1
            return True
        if request.lora == self._draining:
            return False
        keep = {r.lora for r in self.scheduler.running if r.lora is not None} | self._claimed
        slot = self.loras.acquire(request.lora, keep)
        if slot is None:
            if self._draining is None:
                self._draining = self._first_to_end()
            return False
        request.lora_slot = slot
        self._claimed.add(request.lora)
        if self.loras.ready(slot):
            return True
        self._held_for_copy.add(slot)
        return False

    def _schedule(self) -> Batch | None:
        """One scheduling pass (adapters' slots claimed afresh, in queue order)."""
        self._claimed.clear()
        self._held_for_copy.clear()
        return self.scheduler.schedule()

    def _first_to_end(self) -> str | None:
        """Of the adapters running requests use, the one whose requests all end first: by the
        tokens each has left to compute at most (its prompt's rest and its max_new_tokens)."""
        left: dict[str, int] = {}
        for r in self.scheduler.running:
            if r.lora is not None:
                rest = r.num_tokens - r.num_computed + r.params.max_new_tokens - len(r.output_token_ids)
                left[r.lora] = max(left.get(r.lora, 0), rest)
        return min(sorted(left), key=left.__getitem__) if left else None

    def _wait_for_adapter(self) -> bool:
        """Nothing could run: wait for the copies that held requests back when the scheduler
        looked (they may have landed since, so the scheduler must look again), for the head of
        the queue's, or, where the head has no slot while other adapters are being copied into
        every free one (a retracted request back at the head), for those. False when no copy
        held anything back."""
        for slot in self._held_for_copy:
            self.loras.wait(slot)
        if self._held_for_copy:
            return True
        head = self.scheduler.waiting[0] if self.scheduler.waiting else None
        if self.loras is None or head is None or head.lora is None:
            return False
        slot = self.loras.slot_of.get(head.lora)
        if slot is None:
            return self.loras.wait_for_loads()
        if self.loras.ready(slot):
            return False
        self.loras.wait(slot)
        return True

    def _prefetch_adapters(self) -> None:
        """Start copying the adapters of the queued requests, in queue order, into slots that no
        running or earlier-queued request needs, so that each is in place by its admission."""
        keep = {r.lora for r in self.scheduler.running if r.lora is not None}
        for request in self.scheduler.waiting:
            if len(keep) >= self.loras.num_slots:
                return
            if request.lora is None or request.lora in keep:
                continue
            if self.loras.acquire(request.lora, keep) is None:
                return
            keep.add(request.lora)

    def _check_adapter(self, index: int, lora: str | None) -> None:
        if lora is None:
            return
        if self.loras is None:
            raise RequestError(f"prompt {index} asks for adapter {lora!r} but LoRA is off (enable_lora=True or "
                               "lora_modules turn it on)")
        if lora not in self.loras:
            raise RequestError(f"prompt {index} asks for unknown adapter {lora!r} "
                               f"(loaded: {', '.join(self.loras.adapters) or 'none'})")

    def graph_buckets(self) -> list[int]:
        # A bucket is a batch of one-token requests: it must fit both the request and token limits.
        limit = min(self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens)
        if self.cfg.cuda_graph_buckets is not None:
            return sorted(b for b in self.cfg.cuda_graph_buckets if b <= limit)
        return decode_buckets(min(limit, self.cfg.max_cuda_graph_batch))

    def capture_graphs(self, from_artifact: bool = False) -> dict[str, float]:
        """Capture the decode graphs and, for a compiled model, the pieces' graphs, and compile the
        decode kernel as mixed steps' token rows launch it; returns the seconds each took.
        `from_artifact`: every piece came from an artifact, whose export ran the long step sizes
        (`unbucketed_sizes`), so their kernels are cached."""
        seconds = {}
        if buckets := self.graph_buckets():
            seconds["capture"] = self.runner.capture_graphs(buckets, eager_buckets(buckets))
        q_heads = self.model_config.num_attention_heads // self.cfg.tensor_parallel_size
        if warmed := self.runner.warm_token_rows(q_heads):
            seconds["warm_token_rows"] = warmed
        if self.runner.is_compiled and (tokens := self.piecewise_buckets()):
            seconds["capture_piecewise"] = self.runner.capture_piecewise(tokens, eager_token_buckets(tokens))
            seconds["capture_prompt"] = self.runner.capture_prompts(tokens, eager_token_buckets(tokens))
            if not from_artifact and (long_sizes := self.unbucketed_sizes()):
                seconds["warm_up_long"] = self.runner.warm_up(long_sizes)
        return seconds

    def capture_pending_graphs(self, at_most: int | None = None) -> int:
        """Capture the buckets of CUDA graphs left for later at start (`buckets.eager_buckets`,
        `eager_token_buckets`), at most `at_most` of them; returns how many: none while a step is
        in flight. Call it idle (a server between requests): a step needing a bucket not captured
        otherwise waits for its capture."""
        if not self.graphs_left_for_idle:
            return 0
        done = 0
        while not self._unread and (at_most is None or done < at_most) and self.runner.capture_pending():
            done += 1
        return done

    @property
    def graphs_left_for_idle(self) -> int:
        """CUDA-graph buckets `capture_pending_graphs` has left to capture (none under tensor
        parallelism: every rank must capture together, so a step's forward captures what it needs)."""
        return 0 if self.runner.tp is not None else self.runner.num_pending_graphs()

    def unbucketed_sizes(self) -> list[int]:
        """Step sizes to run once at start, beyond the largest piecewise bucket, where steps run
        unpadded without graphs: each kind of kernel specialisation they meet (a token count that
        is or is not a multiple of 16, near the bucket and at the budget, which pick different
        tuned MoE tiles), so that no kernel is compiled while requests wait."""
        largest, budget = self.piecewise_buckets()[-1], self.cfg.max_num_batched_tokens
        return sorted(n for n in {largest + 1, largest + 16, budget - 1, budget} if largest < n <= budget)

    def piecewise_buckets(self) -> list[int]:
        limit = self.cfg.max_num_batched_tokens
        if self.cfg.piecewise_buckets is not None:
            return sorted(b for b in self.cfg.piecewise_buckets if b <= limit)
        return token_buckets(min(self.cfg.max_piecewise_tokens, limit))

    # ---- admission -------------------------------------------------------------------------

    def make_request(self, index: int, prompt: str | list[int], params: SamplingParams,
                     lora: str | None = None, detokenize: bool = True) -> Request:
        """Validate and tokenize one prompt (`index` names it in errors), to run with adapter
        `lora` (None: the base model); nothing is queued yet. `detokenize=False`: the engine
        keeps no text for it and checks no stop strings; the caller does both (a server's front
        end, beside the engine, aborting the request at a stop string)."""
        self._check_adapter(index, lora)
        if not isinstance(params, SamplingParams):
            shown = repr(params).replace("\n", " ")
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise TypeError(f"sampling params of prompt {index}: expected a SamplingParams (or a list of them, one "
                            f"per prompt), got {type(params).__name__} {shown}")
        # Checked again here, not only at construction: a field set afterwards (p.temperature = -1)
        # would otherwise reach the sampler unchecked.
        params.validate()
        check_logit_bias(index, params, self.model_config.vocab_size)
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            if not text:
                raise RequestError(f"prompt {index} is empty")
            if self.tokenizer is None:
                raise RequestError(f"prompt {index} is text but the model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(text)
        elif isinstance(prompt, (Sequence, np.ndarray)):
            ids = check_token_ids(index, prompt, self.model_config.vocab_size)
        else:
            raise RequestError(f"prompt {index} is a {type(prompt).__name__}: expected a str or a list of token ids")
        if not ids:
            raise RequestError(f"prompt {index} is empty")
        if len(ids) >= self.max_context:
            # One position is left for the first generated token.
            raise RequestError(f"prompt {index} has {len(ids)} tokens; the context holds {self.max_context}"
                               f" (max_model_len), so a prompt may have at most {self.max_context - 1}")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.cfg.device).manual_seed(params.seed)
        request = Request(id=next(self._ids), prompt=text, prompt_token_ids=ids, params=params, generator=generator,
                          lora=lora)
        if params.logprobs is not None:
            request.logprobs = []
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        if self.tokenizer is not None and detokenize:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            request.stops = StopChecker.of(params)
        if params.structured_outputs is not None:   # last: its compilation starts now
            request.grammar = self.constraints.make(index, params.structured_outputs)
        return request

    def add(self, request: Request) -> None:
        self._live[request.id] = request
        if request.grammar is not None:
            self.constraints.added(request)
        self.scheduler.add(request)

    def structured_stats(self) -> StructuredStats:
        """Grammar compile times, per-step mask times and counts, so far."""
        return self.constraints.stats()

    def abort(self, request_id: int) -> bool:
        """Stop serving a request now, wherever it is: waiting, part-way through its prompt,
        decoding, or with a step launched ahead that computes its next token. Its KV slots and
        request row go back to the pools; it ends with finish_reason "abort" and `step` does not
        return it. False when no such request is being served (unknown, finished or aborted).
        Call it between steps: the engine is not thread-safe."""
        request = self._live.pop(request_id, None)
        if request is None:
            return False
        request.finish_reason = "abort"
        request.pending = 0
        self.scheduler.abort(request)
        if request.grammar is not None:
            self.constraints.ended(request)
        # A step launched ahead is still read back for its other rows; one with none is dropped.
        self._unread = deque(s for s in self._unread if not all(r.finished for r in s.requests))
        return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._unread)

    # ---- one step --------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Launch one forward pass and read back the tokens of the step before it (or of this
        one, when the next cannot overlap); or, when the next step cannot overlap the one in
        flight, only read that one back. Returns the requests that finished."""
        ahead = self._unread[-1] if self._unread else None
        batch = self.scheduler.schedule_decode() if ahead is not None and self._can_overlap(ahead) else None
        if batch is None:
            if self._unread:
                # The step in flight is read and its tokens handed back now: scheduled behind it,
                # a step that cannot overlap (a prefill, say) would hold them for its whole run.
                while self._unread:
                    self._read_oldest()
                return self._take_finished()
            ahead = None
            if not self.scheduler.has_work:
                return self._take_finished()
            if self.loras is not None and self.scheduler.waiting:
                self._prefetch_adapters()
            if self.constraints.compiling:
                self._end_failed_grammars()
            self._draining = None   # chosen afresh by each step's admissions
            batch = self._schedule()
            while batch is None and self._wait_for_adapter():   # each wait lands a copy
                batch = self._schedule()
            if batch is None and self.constraints.wait():
                return self._take_finished()   # only grammars being compiled: the caller comes back
            if batch is None:
                raise RuntimeError("scheduler found nothing to run although requests are waiting")
        launched = self._launch(batch, None if ahead is None else ahead.token_ids)
        if ahead is not None:
            self.num_overlapped += 1
        if launched is not None:
            self._unread.append(launched)
        while len(self._unread) > 1:
            self._read_oldest()
        # A step launched behind another is left unread even if what was just read (a request
        # finished) keeps the next from overlapping it: reading it here would hold back the
        # tokens just read for its whole run; the next call reads it.
        if launched is not None and ahead is None and not self._can_overlap(launched):
            self._read_oldest()
        return self._take_finished()

    def _end_failed_grammars(self) -> None:
        """End the queued requests whose grammar did not compile, each with its error."""
        for request in self.constraints.failed():
            self.scheduler.abort(request)
            self._live.pop(request.id, None)
            self.constraints.ended(request)
            request.finish_reason, request.error = "abort", request.grammar.error
            self._finished.append(request)

    def _take_finished(self) -> list[Request]:
        finished, self._finished = self._finished, []
        return finished

    def _launch(self, batch: Batch, feed: torch.Tensor | None) -> InFlight | None:
        """Run the model and the sampler on `batch` (input ids of its pending tokens from `feed`).
        Its requests take the results (a pending token each, prompt logprobs) only once all of it
        ran; if any of it raises, the batch is rolled back."""
        sampling = [(c, row) for c, row in zip(batch.chunks, _last_rows(batch)) if c.samples]
        plan = self._prompt_logprob_plan(batch)
        try:
            out = self.runner.forward(batch, [row for _, row in sampling], feed,
                                      logit_rows=[rows for _, _, chunks in plan for rows in chunks])
            prompt_logprobs = self._prompt_logprobs(plan, out.hidden)
            if self.constraints.live and self._unread and any(c.request.grammar is not None for c, _ in sampling):
                # Masks need every earlier token in the matchers: the step ahead is read now,
                # while this one's forward runs.
                while self._unread:
                    self._read_oldest()
            launched = self._sample(out, [c.request for c, _ in sampling]) if sampling else None
        except BaseException:
            self.scheduler.rollback(batch)
            raise
        self.scheduler.share_prompts(batch)
        now = time.perf_counter()
        for chunk in batch.chunks:
            if chunk.request.first_launched is None:
                chunk.request.first_launched = now
        for request, entries in prompt_logprobs:
            request.prompt_logprobs += entries
        for request in launched.requests if launched is not None else ():
            if not request.finished:   # a row the step ahead finished (read above) computes for nothing
                request.pending += 1
        return launched

    def _sample(self, out: StepOutput, requests: list[Request]) -> InFlight:
        mask = self.constraints.mask(requests) if self.constraints.live else None
        sampled = self.sampler(out.logits, SamplingBatch(
            params=[r.params for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            generators=[r.generator for r in requests],
            eos_token_ids=self._eos_sorted,
        ), argmax=out.argmax, grammar=mask)
        return self._readback.start(requests, sampled.token_ids, sampled.logprobs)

    def _read_oldest(self) -> None:
        """Append the oldest unread step's tokens to their requests. A row counts as read before
        its token is appended, so a call that raised part-way resumes after that row."""
        step = self._unread[0]
        tokens = step.tokens()
        while step.num_read < len(step.requests):
            i = step.num_read
            step.num_read += 1
            request = step.requests[i]
            if request.finished:
                continue  # it finished on an earlier token: this one was computed ahead, dropped
            request.pending -= 1
            self._append(request, tokens[i], step.logprobs[i])
            if request.finished:
                self._finish(request)
        self._unread.popleft()

    def _finish(self, request: Request) -> None:
        request.pending = 0
        if request.grammar is not None:
            self.constraints.ended(request)
        self.scheduler.finish(request)
        self._live.pop(request.id, None)
        self._finished.append(request)

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

    def _prompt_logprob_plan(self, batch: Batch) -> list[tuple[Request, range, list[tuple[int, int]]]]:
        """Per request whose prompt logprobs `batch` adds: the prompt positions, and the rows of the
        step's hidden states that give them, `logits_chunk` at a time (a tensor-parallel worker
        computes its share of the same rows' logits: the runner sends them with the step)."""
        plan, offset, step = [], 0, self.cfg.logits_chunk
        for c in batch.chunks:
            positions = _missing_prompt_logprobs(c)
            if positions:
                first = offset + positions.start - c.start
                chunks = [(first + i, first + min(i + step, len(positions))) for i in range(0, len(positions), step)]
                plan.append((c.request, positions, chunks))
            offset += c.length
        return plan

    def _prompt_logprobs(self, plan: list[tuple[Request, range, list[tuple[int, int]]]],
                         hidden: torch.Tensor) -> list[tuple[Request, list[Logprobs]]]:
        """The prompt logprobs of `plan` (`_prompt_logprob_plan`), per request; stored by the caller
        once the step ran."""
        return [(request, self._prompt_logprob_entries(request, hidden, positions, chunks))
                for request, positions, chunks in plan]

    def _prompt_logprob_entries(self, request: Request, hidden: torch.Tensor, positions: range,
                                chunks: list[tuple[int, int]]) -> list[Logprobs]:
        # Row p predicts prompt token p + 1.
        targets = torch.tensor(request.prompt_token_ids[positions.start + 1:positions.stop + 1])
        k, first = request.params.prompt_logprobs, chunks[0][0]
        entries: list[Logprobs] = []
        for start, stop in chunks:
            rows = hidden[start:stop]
            logprobs = torch.log_softmax(self.runner.logits(rows), dim=-1)
            entries += batch_top_logprobs(logprobs, [k] * len(rows), targets[start - first:stop - first].to(rows.device))
        return entries

    def _append(self, request: Request, token: int, logprobs: dict | None) -> None:
        params = request.params
        request.output_token_ids.append(token)
        if request.logprobs is not None:
            request.logprobs.append(logprobs)
        delta = ""
        if request.detokenizer is not None:
            delta = request.detokenizer.step(token)
            request.text += delta
        grammar = request.grammar
        if grammar is not None and not grammar.accept(token):
            request.finish_reason = "abort"
            request.error = f"token {token} is not allowed by the request's structured_outputs.{grammar.spec.kind}"
            return
        n_out = len(request.output_token_ids)
        if n_out >= params.min_new_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                # As vLLM: stop_reason names a stop string or stop token id the user asked for;
                # the model's own end of sequence leaves it None.
                request.finish_reason, request.stop_reason = "stop", None
                return
            if token in params.stop_token_ids:
                request.finish_reason, request.stop_reason = "stop", token
                return
            hit = request.stops.check(request.text, delta) if request.stops is not None else None
            if hit is not None:
                request.text, request.stop_reason = hit.text, hit.stop_str
                request.finish_reason = "stop"
                return
        if grammar is not None and grammar.terminated:   # the grammar took a stop token
            request.finish_reason, request.stop_reason = "stop", None
        elif n_out >= params.max_new_tokens or request.num_resolved >= self.max_context:
            request.finish_reason = "length"


def _missing_prompt_logprobs(chunk: Chunk) -> range:
    """Positions of `chunk` whose rows give prompt logprobs the request does not have yet (row p
    gives entry p + 1; entry 0 is None). A request that recomputes its prompt after a retraction
    already has those of the positions it had computed, and gets only the rest."""
    request = chunk.request
    if request.prompt_logprobs is None:
        return range(0)
    have = len(request.prompt_logprobs)
    positions = range(max(chunk.start, have - 1), min(chunk.start + chunk.length, len(request.prompt_token_ids) - 1))
    assert not positions or positions.start == have - 1, \
        f"request {request.id}: chunk at {chunk.start} skips prompt logprobs from {have}"
    return positions


def _last_rows(batch: Batch) -> list[int]:
    rows, offset = [], 0
    for c in batch.chunks:
        offset += c.length
        rows.append(offset - 1)
    return rows
