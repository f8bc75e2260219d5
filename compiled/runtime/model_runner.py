"""Runs one batch through the model: stages the step's integers (`static_inputs.py`), installs the
attention context, and returns the final hidden states plus the logits of the rows that sample.

The runner owns the CUDA graphs and their capture. Decode batches that fit a bucket replay a
captured graph that also writes the request table and computes the logits (`decode_graphs.py`),
and so does a step of one prompt chunk (`prompt_graphs.py`); everything else runs the (compiled)
model directly, replaying the pieces' graphs where the token count has a bucket."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from compiled.attention.context import AttentionContext, AttentionMetadata, decode_kernel_share
from compiled.attention.kv_cache import KVPool, ReqToTokenPool
from compiled.compilation.buckets import smallest_bucket
from compiled.compilation.piecewise_graphs import PiecewiseGraphs
from compiled.forward_context import PiecewiseMode, current_forward, forward_context
from compiled.lora.merged import MergedLoRA
from compiled.parallel.group import CPError, CPGroup
from compiled.parallel.tensor import TPGroup, set_tp_group
from compiled.passes.variant import BASE, LORA, GraphVariant
from compiled.runtime.config import EngineConfig
from compiled.runtime.context_parallel import ContextParallelRunner, note_step, split_chunks
from compiled.runtime.cp_messages import StepMessage
from compiled.runtime.decode_graphs import DecodeGraphs, compute_logits
from compiled.runtime.prompt_graphs import REQUESTS, PromptGraphs
from compiled.runtime.scheduler import Batch, Chunk
from compiled.runtime.static_inputs import StaticInputs, write_request_table
from compiled.runtime.tensor_parallel import send_step, step_message


def select_rows(x: torch.Tensor, rows: Sequence[int]) -> torch.Tensor | None:
    """`x[rows]`, None for none: a view where the rows are consecutive, else a gather whose index
    goes up from pinned memory. (Indexing a device tensor with a list copies the index from
    pageable memory, which waits for every kernel queued before it: the host stops running ahead
    of a prefill, and its LM head and sampling launch late.)"""
    if not rows:
        return None
    first, n = rows[0], len(rows)
    if rows[-1] - first == n - 1 and list(rows) == list(range(first, first + n)):   # in C: twice a decode step
        return x[first:first + n]
    index = torch.tensor(rows, dtype=torch.int64)
    if x.is_cuda:
        index = index.pin_memory().to(x.device, non_blocking=True)
    return x.index_select(0, index)


# A chunk at least this long is written into the host buffers by slices; shorter ones (a decode
# batch's one-token chunks) are gathered into lists and written with one assignment per field.
SLICE_MIN_TOKENS = 32


class TokenFields:
    """Writes the token fields of a step's chunks (ids, positions, request rows, adapter slots)
    into the host buffers `h`: short chunks gathered in lists (per-chunk slicing costs more than
    their data), long ones (a prompt's thousands of tokens) by slices, which spares building a
    list as long as the prompt. `add` each chunk at its first token `t`, then `flush`."""

    def __init__(self, h: dict, lora: bool) -> None:
        self.h, self.lora, self.start = h, lora, 0
        self.ids, self.positions, self.rows, self.slots = [], [], [], []

    def add(self, c: Chunk, t: int) -> None:
        request, end = c.request, c.start + c.length
        if c.length < SLICE_MIN_TOKENS:
            self.ids += request.token_ids(c.start, end)
            self.positions += range(c.start, end)
            self.rows += [request.row] * c.length
            if self.lora:   # only the LoRA graph reads them
                self.slots += [request.lora_slot] * c.length
            return
        self.flush()
        h, s = self.h, slice(t, t + c.length)
        h["input_ids"][s] = request.token_ids(c.start, end)
        h["positions"][s] = np.arange(c.start, end)
        h["token_rows"][s] = request.row
        if self.lora:
            h["lora_slots"][s] = request.lora_slot
        self.start = t + c.length

    def flush(self) -> None:
        """Write the gathered short chunks, which sit from `start` on."""
        h, s = self.h, slice(self.start, self.start + len(self.ids))
        h["input_ids"][s] = self.ids
        h["positions"][s] = self.positions
        h["token_rows"][s] = self.rows
        if self.lora:
            h["lora_slots"][s] = self.slots
        self.start = s.stop
        self.ids, self.positions, self.rows, self.slots = [], [], [], []


@dataclass
class StepOutput:
    """After a graph replay, views of the graphs' static buffers: read (enqueue reads) before the
    next replay, which overwrites them."""
    hidden: torch.Tensor   # [T, H] final hidden states in chunk order
    logits: torch.Tensor | None  # [len(sample_rows), V] fp32; None when no row samples
    argmax: torch.Tensor | None = None  # [len(sample_rows)] their argmax, where a decode graph computed it


@dataclass
class VariantGraphs:
    """A graph variant's model and the CUDA graphs captured of it (once captured)."""
    model: nn.Module
    decode: DecodeGraphs | None = None
    piecewise: PiecewiseGraphs | None = None
    prompt: PromptGraphs | None = None
    # The graph fields above, in the order pending buckets are captured.
    KINDS = ("decode", "piecewise", "prompt")


class ModelRunner:
    """Runs one of `models`, the graphs of one model by variant (`passes/variant.py`): BASE, and
    with LoRA on, LORA (the same weights with the adapters' deltas) for a batch in which some
    request uses an adapter. Each has CUDA graphs of its own, in `variants`."""

    def __init__(self, models: dict[GraphVariant, nn.Module], cfg: EngineConfig, kv: KVPool,
                 req_pool: ReqToTokenPool) -> None:
        self.cfg, self.kv, self.req_pool = cfg, kv, req_pool
        # Capture and warm-up order: BASE first.
        self.variants = {v: VariantGraphs(models[v]) for v in sorted(models, key=lambda v: v != BASE)}
        self.serves_lora = LORA in self.variants
        self.merged: MergedLoRA | None = None   # the engine's, with `merge_lora`
        # One request more than the scheduler admits: the padding request of a piecewise bucket.
        self.inputs = StaticInputs(cfg.max_num_batched_tokens, cfg.max_num_seqs + 1, cfg.device)
        # Token buckets non-decode batches are padded to (with or without captured graphs).
        self.prefill_buckets: list[int] = []
        self._pool = None           # one CUDA-graph memory pool for every graph
        self.cp: ContextParallelRunner | None = None   # with a context-parallel group (`enable_cp`)
        self.tp: CPGroup | None = None   # with a tensor-parallel group (`enable_tp`)
        self.tp_failure: str | None = None   # why the tensor-parallel group ended, once it has
        # Rank 0: request-table rows the scheduler pointed at cached K/V since the last step (the
        # engine shares the list with its scheduler), for the workers' tables.
        self.pointed: list[tuple[int, int, np.ndarray]] = []

    @property
    def model(self) -> nn.Module:
        """The BASE graph (its `lm_head` computes every variant's logits)."""
        return self.variants[BASE].model

    def enable_cp(self, group, cp_model: nn.Module) -> None:
        """Run the steps that split (`context_parallel.split_chunks`) over `group` with `cp_model`."""
        self.cp = ContextParallelRunner(group, cp_model, self.kv, self.req_pool, self.inputs,
                                        uses_lora=self.serves_lora)

    def enable_tp(self, group: CPGroup) -> None:
        """Run every step on every rank of `group` (`tensor_parallel.py`), whose data group the
        all-reduce op reduces over."""
        self.tp = group
        set_tp_group(TPGroup(group.data, group.world, group.rank))

    def _graph_pool(self):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    @property
    def is_compiled(self) -> bool:
        """Whether the model is split into compiled pieces (which have graphs of their own)."""
        from compiled.compilation.inductor import CompiledModel
        return isinstance(self.model, CompiledModel)

    def capture_graphs(self, buckets: list[int], now: list[int]) -> float:
        """Set up the decode CUDA graphs of `buckets` (of every variant) and capture those of
        `now` (the others on first use, or by `capture_pending`); returns the seconds it took."""
        seconds = 0.0
        for entry in self.variants.values():
            entry.decode = DecodeGraphs(entry.model, self.kv, self.req_pool, buckets, self._graph_pool(),
                                        self.cfg.device)
            entry.decode.capture(now)
            seconds += entry.decode.capture_seconds
        return seconds

    def warm_token_rows(self, q_heads: int) -> float:
        """On CUDA with the Triton attention, the decode-kernel launches of a mixed step's token
        rows compiled now (`attention.ops.warm_token_rows`); returns the seconds it took."""
        from compiled.attention import ops as attention_ops
        if self.cfg.device.type != "cuda" or attention_ops.BACKEND.name == "torch":
            return 0.0
        start = time.perf_counter()
        attention_ops.warm_token_rows(self.kv, self.req_pool.table, self.req_pool.padding_row, q_heads,
                                      self.cfg.dtype, self.inputs.token_rows.dtype)
        torch.cuda.synchronize(self.cfg.device)
        return time.perf_counter() - start

    def capture_piecewise(self, buckets: list[int], now: list[int]) -> float:
        """Set up every compiled piece's graphs per token bucket of `buckets` (of every variant)
        and capture those of `now` (the others as `capture_graphs` leaves them); returns the
        seconds it took."""
        seconds = 0.0
        for variant, entry in self.variants.items():
            graphs = PiecewiseGraphs(buckets, self._graph_pool(), [self.inputs.input_ids, self.inputs.positions],
                                     functools.partial(self._padding_only, variant=variant))
            graphs.attach(entry.model.pieces)
            self.prefill_buckets = graphs.buckets
            entry.piecewise = graphs   # the capture's forwards write attention into its slab too
            try:
                graphs.capture(now)
            except BaseException:
                entry.piecewise = None
                raise
            seconds += graphs.capture_seconds
        return seconds

    def capture_prompts(self, buckets: list[int], now: list[int]) -> float:
        """Set up the one-chunk prefill graphs of `buckets` (of every variant) and capture those of
        `now` (the others as `capture_graphs` leaves them); returns the seconds it took."""
        seconds = 0.0
        stage = functools.partial(self._stage, seqs=REQUESTS)
        for variant, entry in self.variants.items():
            entry.prompt = PromptGraphs(entry.model, self.model.lm_head, self.kv, self.req_pool, self.inputs, stage,
                                        self.inputs.lora_slots if variant.lora else None, buckets,
                                        self._graph_pool(), self.cfg.device)
            entry.prompt.capture(now)
            seconds += entry.prompt.capture_seconds
        return seconds

    def release_graphs(self) -> None:
        """Free every captured graph, after the GPU is done with them; the steps after run eagerly.
        A graph that captured a collective holds its NCCL communicator: the group's teardown waits
        for the graph to go."""
        if self.cfg.device.type == "cuda":
            torch.cuda.synchronize(self.cfg.device)
        for entry in self.variants.values():
            for kind in VariantGraphs.KINDS:
                graphs = getattr(entry, kind)
                if graphs is not None:
                    graphs.release()
                setattr(entry, kind, None)

    def _graph_kinds(self) -> list:
        """Every variant's graphs of each kind that exist, in the order pending buckets are captured."""
        kinds = [getattr(e, kind) for kind in VariantGraphs.KINDS for e in self.variants.values()]
        return [graphs for graphs in kinds if graphs is not None]

    def capture_pending(self) -> bool:
        """Capture one bucket not captured yet, decode graphs first, smallest first (call it
        between steps with none in flight); False when there is none."""
        for graphs in self._graph_kinds():
            if graphs.pending:
                graphs.capture(graphs.pending[:1])
                return True
        return False

    def num_pending_graphs(self) -> int:
        """Buckets of every variant and kind not captured yet."""
        return sum(len(graphs.pending) for graphs in self._graph_kinds())

    def warm_up(self, sizes: list[int]) -> float:
        """A padding-only batch of each of `sizes` tokens through each variant (the compiles and
        tuned-config loads those step sizes need); returns the seconds it took."""
        start = time.perf_counter()
        for variant in self.variants:
            for tokens in sizes:
                self._padding_only(tokens, variant)
        if self.cfg.device.type == "cuda":
            torch.cuda.synchronize(self.cfg.device)
        return time.perf_counter() - start

    @torch.inference_mode()
    def _padding_only(self, tokens: int, variant: GraphVariant) -> None:
        """A batch of nothing but the padding request, `tokens` long (for capture)."""
        self._run_model(self._stage([], tokens), tokens, variant)

    def _stage(self, chunks: list, tokens: int, is_decode: bool = False,
               inputs: StaticInputs | None = None, seqs: int = 0) -> AttentionMetadata:
        """Fill the host buffer of `inputs` (default: the runner's) with `chunks` padded to `tokens`
        and upload it. A decode batch pads with one request per token (its graph has one row per
        request), anything else with one padding request, then empty ones up to `seqs` requests."""
        inp = inputs or self.inputs
        h = inp.begin()
        fields = TokenFields(h, self.serves_lora)
        starts, rows, seq_lens, ext_lens = [], [], [], []
        t = 0
        for c in chunks:
            fields.add(c, t)
            starts.append(t)
            rows.append(c.request.row)
            seq_lens.append(c.start + c.length)
            ext_lens.append(c.length)
            t += c.length
        fields.flush()
        b = len(rows)
        if chunks:
            h["out_cache_loc"][:t] = np.concatenate([c.slots for c in chunks])
        h["extend_start_loc"][:b] = starts
        h["req_pool_indices"][:b] = rows
        h["seq_lens"][:b] = seq_lens
        h["extend_lens"][:b] = ext_lens
        padding_row = self.req_pool.padding_row
        if is_decode:
            inp.pad_decode(t, tokens, padding_row)
        elif tokens > t:
            inp.pad_extend(t, b, tokens, padding_row)
            rows, seq_lens, ext_lens = rows + [padding_row], seq_lens + [tokens - t], ext_lens + [tokens - t]
            b += 1
        if b < seqs:
            inp.pad_requests(b, seqs, tokens, padding_row)
            rows, seq_lens, ext_lens = rows + [padding_row] * (seqs - b), seq_lens + [0] * (seqs - b), \
                ext_lens + [0] * (seqs - b)
            b = seqs
        inp.upload()
        meta = AttentionMetadata(
            out_cache_loc=inp.out_cache_loc[:tokens], req_pool_indices=inp.req_pool_indices[:b],
            seq_lens=inp.seq_lens[:b], extend_lens=inp.extend_lens[:b],
            req_pool_indices_cpu=rows, seq_lens_cpu=seq_lens, extend_lens_cpu=ext_lens,
            is_decode=is_decode, extend_start_loc=inp.extend_start_loc[:b])
        if not is_decode:
            meta.decode_rows, leading = decode_kernel_share([(c.length, c.start) for c in chunks],
                                                            self.req_pool.table.shape[0])
            if leading > meta.decode_rows:   # a chunk of several tokens among them: a row a token
                meta.token_rows, meta.token_positions = inp.token_rows[:leading], inp.positions[:leading]
        return meta

    def _run_model(self, meta: AttentionMetadata, tokens: int, variant: GraphVariant = BASE) -> torch.Tensor:
        write_request_table(self.req_pool.table, self.inputs, tokens)
        entry = self.variants[variant]
        pw = entry.piecewise
        graphed = pw is not None and tokens in pw.buckets
        attention = AttentionContext(meta=meta, kv=self.kv, req_to_token=self.req_pool.table,
                                     attention_out=pw.attention_out if graphed else None)
        # Outside a capture (PiecewiseGraphs.capture sets its own mode around this forward).
        replay = graphed and current_forward().piecewise is None
        if replay:
            pw.replays += 1
        with forward_context(attention, self.inputs.lora_slots if variant.lora else None,
                             piecewise=PiecewiseMode(tokens) if replay else None):
            return entry.model(self.inputs.input_ids[:tokens], self.inputs.positions[:tokens])

    def _variant(self, batch: Batch) -> GraphVariant:
        """The graph that runs `batch`: LORA when some request of it uses an adapter (unless the
        merged weights serve it), else BASE."""
        lora = self.serves_lora and any(c.request.lora_slot >= 0 for c in batch.chunks)
        if self.merged is not None:   # one adapter folded into the weights runs the base graphs
            lora = self.merged.prepare([c.request for c in batch.chunks], lora)
        return LORA if lora else BASE

    def _decode_bucket(self, batch: Batch, graphs: DecodeGraphs | None) -> int | None:
        if graphs is None or not batch.is_decode:
            return None
        return graphs.bucket_for(len(batch.chunks))

    def _prefill_bucket(self, tokens: int) -> int:
        """Padded size of a non-decode batch: its bucket, or itself past the largest."""
        return smallest_bucket(self.prefill_buckets, tokens) or tokens

    @torch.inference_mode()
    def forward(self, batch: Batch, sample_rows: Sequence[int] = (), feed: torch.Tensor | None = None,
                logit_rows: Sequence[tuple[int, int]] = ()) -> StepOutput:
        """Run `batch`; logits only for `sample_rows` (indices into the batch's tokens). `feed`:
        the input ids of a one-token-per-request batch, on the device (overlap scheduling; the
        host does not know them yet). `logit_rows`: the (start, stop) rows of the hidden states
        whose `logits` the caller asks for next, in order (a tensor-parallel worker joins each)."""
        if self.tp is None:
            out = self._split(batch, sample_rows)
            return out if out is not None else self._forward(batch, sample_rows, feed)
        if self.tp_failure is not None:
            raise CPError(self.tp_failure)
        group = self.tp
        try:
            with group.collectives():
                if group.schedules:
                    return self._lead(batch, sample_rows, feed, logit_rows)
                return self._forward(batch, sample_rows, feed)
        except CPError as e:
            # A rank died or hangs: no rank can run the model without the others' shards.
            self.tp_failure = str(e)
            if group.schedules:
                group.shutdown()
            raise

    def _lead(self, batch: Batch, sample_rows: Sequence[int], feed: torch.Tensor | None,
              logit_rows: Sequence[tuple[int, int]]) -> StepOutput:
        """Rank 0 of a tensor-parallel group: the batch split over the context-parallel ranks (each
        a tensor-parallel group) when a chunk of it splits, else run by this tensor-parallel group,
        its workers told first (tensor_parallel.py)."""
        out = self._split(batch, sample_rows, logit_rows)
        if out is not None:
            return out
        writes, self.pointed[:] = list(self.pointed), []
        send_step(self.tp, step_message(batch, sample_rows, feed, writes, logit_rows), feed)
        return self._forward(batch, sample_rows, feed)

    def _split(self, batch: Batch, sample_rows: Sequence[int],
               logit_rows: Sequence[tuple[int, int]] = ()) -> StepOutput | None:
        """Rank 0 with a context-parallel group: the batch as a context-parallel step; None when
        there is no group or no chunk of the batch splits (it then runs without the other ranks)."""
        if self.cp is None:
            return None
        out = self._forward_cp(batch, sample_rows, logit_rows)
        note_step(batch, on_all_ranks=out is not None)
        return out

    def _forward(self, batch: Batch, sample_rows: Sequence[int], feed: torch.Tensor | None) -> StepOutput:
        t = batch.num_tokens
        variant = self._variant(batch)
        entry = self.variants[variant]
        graphs = entry.decode
        bucket = self._decode_bucket(batch, graphs)
        if bucket is not None:   # the graphs read their own small buffer: a short upload
            feed = self._capture_first(graphs, bucket, feed)
            self._stage(batch.chunks, bucket, is_decode=True, inputs=graphs.inputs)
            self._feed(feed, t, graphs.inputs)
            hidden, logits, argmax = graphs.replay(bucket)
            return StepOutput(hidden[:t], select_rows(logits, sample_rows), select_rows(argmax, sample_rows))
        prompt = entry.prompt
        bucket = None
        if prompt is not None and not batch.is_decode and feed is None:
            bucket = prompt.serves(batch.chunks, list(sample_rows))
        if bucket is not None:   # one chunk: a graph of the whole step
            self._capture_first(prompt, bucket, None)
            prompt.stage(batch.chunks, bucket)
            hidden, logits = prompt.replay(bucket)
            return StepOutput(hidden[:t], logits if sample_rows else None)
        tokens = self._prefill_bucket(t)
        feed = self._capture_first(entry.piecewise, tokens, feed)
        meta = self._stage(batch.chunks, tokens, is_decode=batch.is_decode and tokens == t)
        self._feed(feed, t, self.inputs)
        hidden = self._run_model(meta, tokens, variant)[:t]
        rows = select_rows(hidden, sample_rows)
        return StepOutput(hidden, None if rows is None else self.logits(rows))

    def _forward_cp(self, batch: Batch, sample_rows: Sequence[int],
                    logit_rows: Sequence[tuple[int, int]]) -> StepOutput | None:
        """Rank 0: the batch as a context-parallel step, the workers told first; None when no
        chunk of it splits."""
        chunks = split_chunks(batch, self.cp.group.world, self.cfg.cp_min_tokens)
        if chunks is None:
            return None
        adapters = {c.request.lora_slot: c.request.lora for c in batch.chunks if c.request.lora_slot >= 0}
        message = StepMessage(chunks, adapters)
        if self.tp is not None:   # every worker points its table; rank 0's tensor-parallel group joins the logits
            message.table_writes, self.pointed[:] = list(self.pointed), []
            message.sample_rows, message.logit_rows = list(sample_rows), list(logit_rows)
        try:
            self.cp.group.send(message)
            hidden = self.cp.run(chunks)
        except CPError:
            # A rank died or hangs: stop them all (`forward` does, tensor-parallel); later steps
            # run on this process alone, or, tensor-parallel, not at all.
            group, self.cp = self.cp.group, None
            if self.tp is None:
                group.shutdown()
            raise
        rows = select_rows(hidden, sample_rows)
        return StepOutput(hidden, None if rows is None else self.logits(rows))

    @staticmethod
    def _capture_first(graphs: DecodeGraphs | PiecewiseGraphs | None, bucket: int,
                       feed: torch.Tensor | None) -> torch.Tensor | None:
        """Capture `bucket` of `graphs` if it is one left for later, before the step stages its
        batch: the capture stages and runs padding-only batches through the same buffers, where
        `feed` (the previous step's tokens, then cloned first) may also live. Returns the feed."""
        if graphs is None or not graphs.is_pending(bucket):
            return feed
        feed = None if feed is None else feed.clone()
        graphs.capture([bucket])
        return feed

    @staticmethod
    def _feed(feed: torch.Tensor | None, t: int, inputs: StaticInputs) -> None:
        if feed is not None:
            assert feed.shape == (t,), f"feed of {tuple(feed.shape)} for {t} tokens"
            inputs.input_ids[:t].copy_(feed)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return compute_logits(self.model.lm_head, hidden)
        with self.tp.collectives():   # a vocab-parallel head gathers every rank's logits
            return compute_logits(self.model.lm_head, hidden)
