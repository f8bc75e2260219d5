"""Turns one step's logits into next tokens, one row per request.

Order of operations follows vLLM: logprobs come from the raw logits; then
penalties, min_new_tokens masking, and either argmax (greedy rows) or
temperature -> top-k -> top-p -> min-p -> sampling (all other rows).

Every row may carry different parameters, so per-row settings become small
[B, 1] tensors and the [B, V] work stays batched. The only per-row Python loop
that touches the device is the random draw of seeded rows: a seeded request
must consume randomness from its own generator alone, so it samples the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compiled.structured.bitmask import GrammarMask

from .sampling_params import SamplingParams

_NEG_INF = float("-inf")
# Token ids travel as float32 when packing a single device->host copy.
_MAX_EXACT_FLOAT32_INT = 2**24


# --------------------------------------------------------------------------- #
# Batch description and result
# --------------------------------------------------------------------------- #


@dataclass
class SamplingBatch:
    """Per-row state for one sampler call, built by the engine every step."""

    params: list[SamplingParams]
    output_token_ids: list[list[int]]  # tokens generated so far (presence/frequency, min_new_tokens)
    prompt_token_ids: list[list[int]]  # repetition penalty looks at prompt + output
    generators: list[torch.Generator | None]  # one per seeded request, see make_generator
    eos_token_ids: Sequence[int] = ()  # model-wide EOS ids, masked under min_new_tokens

    def __post_init__(self) -> None:
        rows = len(self.params)
        for name in ("output_token_ids", "prompt_token_ids", "generators"):
            if len(getattr(self, name)) != rows:
                raise ValueError(
                    f"SamplingBatch.{name} has {len(getattr(self, name))} rows, params has {rows}"
                )

    def __len__(self) -> int:
        return len(self.params)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, on the logits' device
    # Per row, when params.logprobs is not None: top-N raw logprobs plus the
    # sampled token's, keyed by token id. None for rows that did not ask.
    logprobs: list[dict[int, float] | None]


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The generator a seeded request keeps for its whole life; None when unseeded."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


# --------------------------------------------------------------------------- #
# Small helpers
# --------------------------------------------------------------------------- #


def _to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Pinned staging lets the copy run asynchronously instead of stalling the host.
    if device.type == "cuda":
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype, device=device)


def _column(values: torch.Tensor) -> torch.Tensor:
    """Accept [B] or [B, 1] per-row values; broadcast them against [B, V]."""
    return values.unsqueeze(1) if values.dim() == 1 else values


def _int64_to_device(values: array, device: torch.device) -> torch.Tensor:
    """Upload a flat array('q') without a per-element Python conversion."""
    host = torch.frombuffer(values, dtype=torch.int64) if len(values) else torch.empty(0, dtype=torch.int64)
    if device.type == "cuda":
        # frombuffer aliases `values`; the pinned copy decouples the async upload from it.
        staged = torch.empty(host.shape, dtype=torch.int64, pin_memory=True).copy_(host)
        return staged.to(device, non_blocking=True)
    return host.to(device, copy=True)


# --------------------------------------------------------------------------- #
# Penalties and masking (pure functions: their inputs are never modified)
# --------------------------------------------------------------------------- #


def token_counts(
    rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[B, V] int32: how often each token id occurs in each row. Ids must be in [0, V)."""
    device = torch.device(device)
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.int32, device=device)
    lengths = [len(r) for r in rows]
    total = sum(lengths)
    if total == 0:
        return counts
    # One flat upload (row lengths, then every id) instead of a padded nested
    # list: converting Python ints dominates the cost for long prompts.
    flat = array("q", lengths)
    flat.extend(itertools.chain.from_iterable(rows))
    uploaded = _int64_to_device(flat, device)
    lengths_t, ids = uploaded[: len(rows)], uploaded[len(rows) :]
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths_t, output_size=total)
    counts.view(-1).scatter_add_(0, row_of * vocab_size + ids, torch.ones_like(ids, dtype=torch.int32))
    return counts


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """Divide positive / multiply negative logits of `seen` tokens by the row's penalty.

    seen: [B, V] bool (token occurs in prompt or output); penalty: [B] or [B, 1].
    """
    penalty = _column(penalty)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """logits - frequency * count - presence * (count > 0), counts over output tokens only."""
    return logits - _column(frequency) * counts - _column(presence) * (counts > 0)


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Each row's `logit_bias` added to its logits (ids were checked against the vocabulary when
    the request was made); `logits` itself unchanged."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, params in enumerate(batch.params):
        for token, bias in (params.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            values.append(bias)
    if not rows:
        return logits
    index = _to_device([rows, cols], torch.int64, logits.device)
    return logits.index_put((index[0], index[1]), _to_device(values, logits.dtype, logits.device), accumulate=True)


def min_new_tokens_mask_ids(batch: SamplingBatch, vocab_size: int) -> tuple[list[int], list[int]]:
    """(rows, token ids) to forbid: stop tokens of rows still short of min_new_tokens.

    EOS is forbidden too unless the request ignores it (then it is no stop anyway).
    """
    rows: list[int] = []
    cols: list[int] = []
    for i, (params, output) in enumerate(zip(batch.params, batch.output_token_ids)):
        if len(output) >= params.min_new_tokens:
            continue
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(batch.eos_token_ids)
        # Ids past the logits' width cannot be sampled, so there is nothing to mask.
        kept = sorted(t for t in stop_ids if t < vocab_size)
        rows.extend([i] * len(kept))
        cols.extend(kept)
    return rows, cols


def apply_min_new_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    rows, cols = min_new_tokens_mask_ids(batch, logits.shape[1])
    if not rows:
        return logits
    index = _to_device([rows, cols], torch.int64, logits.device)
    masked = logits.clone()
    masked[index[0], index[1]] = _NEG_INF
    return masked


# --------------------------------------------------------------------------- #
# Temperature, top-k, top-p, min-p
# --------------------------------------------------------------------------- #


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (> 0).

    The row max is subtracted first so that a tiny temperature sends other
    tokens to -inf instead of overflowing to +inf (inf - inf = NaN in softmax).
    """
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    return shifted.div_(_column(temperature))


def _top_k_cutoff(sorted_desc: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[B, 1] value of the k-th largest logit; -inf where top_k == 0 (off)."""
    top_k = _column(top_k)
    kth = sorted_desc.gather(1, top_k.clamp(min=1) - 1)
    return kth.masked_fill(top_k == 0, _NEG_INF)


def _top_p_cutoff(
    sorted_desc: torch.Tensor, k_cutoff: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """[B, 1] smallest logit in the top-p nucleus, computed after top-k."""
    top_p = _column(top_p)
    masked = sorted_desc.masked_fill(sorted_desc < k_cutoff, _NEG_INF)
    cumulative = masked.softmax(dim=-1).cumsum(dim=-1)
    # A token is kept while the mass of the tokens ranked above it is < top_p;
    # the top token has nothing above it and so is always kept.
    n_keep = 1 + (cumulative[:, :-1] < top_p).sum(dim=-1, keepdim=True)
    cutoff = masked.gather(1, n_keep - 1)
    return cutoff.masked_fill(top_p >= 1.0, _NEG_INF)


def _with_top_p(
    logits: torch.Tensor, k_cutoff: torch.Tensor, top_p: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """Raise k_cutoff to the top-p cutoff, sorting only `rows` (all rows if None)."""
    if rows is None:
        sorted_desc = logits.sort(dim=-1, descending=True).values
        return torch.maximum(k_cutoff, _top_p_cutoff(sorted_desc, k_cutoff, top_p))
    sub_k = k_cutoff.index_select(0, rows)
    sorted_desc = logits.index_select(0, rows).sort(dim=-1, descending=True).values
    sub = torch.maximum(sub_k, _top_p_cutoff(sorted_desc, sub_k, top_p.index_select(0, rows)))
    return k_cutoff.index_copy(0, rows, sub)


def sampling_cutoff(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    max_top_k: int | None = None,
    top_p_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, 1] logit below which a token is dropped by top-k, then top-p, then min-p.

    top_k: int64 [B], 0 = off, at most V; top_p: [B] in (0, 1], 1 = off;
    min_p: [B] in [0, 1], 0 = off. None skips that filter for every row.
    Optional host-side hints that save work: max_top_k = max(top_k) (no device
    sync to find it); top_p_rows = int64 indices of the rows with top_p < 1
    (only those are sorted, the costliest step).

    Each filter is expressed as a value threshold rather than a set of sorted
    positions, so tokens tied with the boundary are all kept. That makes the
    allowed set independent of how sort/topk break ties, which can differ with
    batch shape and between CPU and CUDA.
    """
    cutoff = torch.full((logits.shape[0], 1), _NEG_INF, device=logits.device)
    if top_k is not None:
        if max_top_k is None:
            max_top_k = int(top_k.max())
        if max_top_k > 0:
            # The k-th largest value needs only topk(max k), far cheaper than a full sort.
            cutoff = _top_k_cutoff(logits.topk(min(max_top_k, logits.shape[1]), dim=-1).values, top_k)
    if top_p is not None:
        cutoff = _with_top_p(logits, cutoff, _column(top_p), top_p_rows)
    if min_p is not None:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf is "off".
        max_logit = logits.amax(dim=-1, keepdim=True)
        cutoff = torch.maximum(cutoff, max_logit + _column(min_p).log())
    return cutoff


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    max_top_k: int | None = None,
    top_p_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Set every token outside the allowed set to -inf (see sampling_cutoff)."""
    cutoff = sampling_cutoff(logits, top_k, top_p, min_p, max_top_k, top_p_rows)
    return logits.masked_fill(logits < cutoff, _NEG_INF)


# --------------------------------------------------------------------------- #
# Drawing tokens
# --------------------------------------------------------------------------- #


def sample_tokens(
    logits: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    skip: Sequence[bool] | None = None,
) -> torch.Tensor:
    """[B] tokens drawn from softmax(logits) by the exponential race argmax(p / q).

    q ~ Exp(1) per token. Seeded rows draw q from their own generator only;
    the rest share one batched draw from the global RNG. Rows marked in `skip`
    (greedy rows whose sample is discarded) consume none of their generator.
    """
    probs = logits.softmax(dim=-1)
    q = torch.empty_like(probs)
    seeded = [g is not None and not (skip is not None and skip[i]) for i, g in enumerate(generators)]
    if not all(seeded):
        q.exponential_()
    for i, generator in enumerate(generators):
        if seeded[i]:
            q[i].exponential_(generator=generator)
    # Guard q == 0: 0 / 0 = NaN would win argmax and could pick a masked token.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


# --------------------------------------------------------------------------- #
# Logprobs
# --------------------------------------------------------------------------- #


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log_softmax over the vocabulary; use on raw (unprocessed) logits."""
    return torch.log_softmax(logits.float(), dim=-1)


def _normalise_ks(ks: int | Sequence[int], rows: int, vocab_size: int) -> list[int]:
    ks = [ks] * rows if isinstance(ks, int) else list(ks)
    if len(ks) != rows:
        raise ValueError(f"batch_top_logprobs: got {len(ks)} ks for {rows} rows")
    if any(k < -1 for k in ks):
        raise ValueError(f"batch_top_logprobs: ks must be -1 or >= 0, got {ks}")
    return [vocab_size if k == -1 else min(k, vocab_size) for k in ks]


def _chosen_tensor(
    chosen: torch.Tensor | Sequence[int | None] | None, rows: int, device: torch.device
) -> torch.Tensor:
    """[N] int64 with -1 where a row has no chosen token."""
    if chosen is None:
        return torch.full((rows,), -1, dtype=torch.int64, device=device)
    if isinstance(chosen, torch.Tensor):
        return chosen.to(device=device, dtype=torch.int64).reshape(rows)
    return _to_device([-1 if c is None else c for c in chosen], torch.int64, device).reshape(rows)


def batch_top_logprobs(
    logprobs: torch.Tensor,
    ks: int | Sequence[int],
    chosen: torch.Tensor | Sequence[int | None] | None = None,
) -> list[dict[int, float]]:
    """Per row {token id: logprob} for the k most likely tokens plus the chosen one.

    logprobs: [N, V] (e.g. compute_logprobs(raw_logits)); ks: one k for all rows
    or one per row, -1 = whole vocabulary, 0 = only the chosen token; chosen:
    [N] token ids, None / negative entries meaning "none". Entries are ordered
    by rank, the chosen token last if it is not among them. Everything comes
    back in a single device->host copy.
    """
    rows, vocab = logprobs.shape
    if vocab >= _MAX_EXACT_FLOAT32_INT:
        raise ValueError(f"batch_top_logprobs: vocab {vocab} too large to pack ids as float32")
    ks = _normalise_ks(ks, rows, vocab)
    chosen_ids = _chosen_tensor(chosen, rows, logprobs.device)
    chosen_lp = logprobs.gather(1, chosen_ids.clamp(min=0).unsqueeze(1))
    # topk over the largest k requested; rows that asked for fewer slice below.
    top_lp, top_ids = logprobs.topk(max(ks, default=0), dim=-1)
    packed = torch.cat(
        [top_lp.float(), top_ids.float(), chosen_lp.float(), chosen_ids.float().unsqueeze(1)], dim=1
    ).tolist()
    width = top_lp.shape[1]
    result = []
    for row, k in zip(packed, ks):
        entries = dict(zip((int(t) for t in row[width : width + k]), row[:k]))
        chosen_id = int(row[2 * width + 1])
        if chosen_id >= 0:
            entries.setdefault(chosen_id, row[2 * width])
        result.append(entries)
    return result


def top_logprobs(logprobs_row: torch.Tensor, k: int, chosen: int | None = None) -> dict[int, float]:
    """{token id: logprob} for the k most likely tokens (-1 = all) plus `chosen`."""
    return batch_top_logprobs(logprobs_row.unsqueeze(0), [k], [chosen])[0]


# --------------------------------------------------------------------------- #
# The sampler
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class _Plan:
    """Host-side decisions for one call, taken from params without touching the device."""

    greedy: list[bool]
    top_k: list[int]  # 0 = off, clamped to V
    repetition: list[bool]  # rows with a repetition penalty
    presence_frequency: list[bool]  # rows with a presence or frequency penalty
    top_p_rows: list[int]  # sampled rows with top_p < 1
    any_min_p: bool

    @property
    def any_repetition(self) -> bool:
        return any(self.repetition)

    @property
    def any_presence_frequency(self) -> bool:
        return any(self.presence_frequency)

    @property
    def needs_rows(self) -> bool:
        return not all(self.greedy) or self.any_repetition or self.any_presence_frequency

    @property
    def any_top_k(self) -> bool:
        return any(k > 0 for k in self.top_k)

    @staticmethod
    def build(params: Sequence[SamplingParams], vocab_size: int) -> _Plan:
        greedy = [p.greedy for p in params]
        # Greedy rows get neutral filters: their sample is discarded anyway, and
        # it keeps their settings out of the batch-wide decisions below.
        top_k = [0 if g or p.top_k <= 0 or p.top_k >= vocab_size else p.top_k for p, g in zip(params, greedy)]
        return _Plan(
            greedy=greedy,
            top_k=top_k,
            repetition=[p.has_repetition_penalty for p in params],
            presence_frequency=[p.has_presence_frequency_penalty for p in params],
            top_p_rows=[i for i, (p, g) in enumerate(zip(params, greedy)) if not g and p.top_p < 1.0],
            any_min_p=any(p.min_p > 0.0 for p, g in zip(params, greedy) if not g),
        )


@dataclass
class _RowTensors:
    """Per-row settings as [B, 1] device columns, uploaded in one copy."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor

    @staticmethod
    def build(params: Sequence[SamplingParams], plan: _Plan, device: torch.device) -> _RowTensors:
        rows = []
        for p, greedy, k in zip(params, plan.greedy, plan.top_k):
            # Neutral values for greedy rows: temperature 0 must not reach a division.
            temperature, top_p, min_p = (1.0, 1.0, 0.0) if greedy else (p.temperature, p.top_p, p.min_p)
            rows.append(
                [temperature, float(k), top_p, min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty]
            )
        # float32 holds every top_k exactly: vocabularies are far below 2**24.
        table = _to_device(rows, torch.float32, device)
        columns = [table[:, i : i + 1] for i in range(table.shape[1])]
        columns[1] = columns[1].long()
        return _RowTensors(*columns)


def _greedy(logits: torch.Tensor, argmax: torch.Tensor | None) -> torch.Tensor:
    """Each row's argmax: the one the step computed, else torch's."""
    return logits.argmax(dim=-1) if argmax is None else argmax


def _only(rows: Sequence[Sequence[int]], keep: Sequence[bool]) -> list[Sequence[int]]:
    return [r if k else () for r, k in zip(rows, keep)]


class Sampler:
    """Stateless: all per-request state arrives in the SamplingBatch."""

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, argmax: torch.Tensor | None = None,
                 grammar: GrammarMask | None = None) -> SamplerOutput:
        """`argmax`: each row's argmax of `logits`, if the step computed it already (the decode
        graphs do); taken for greedy rows when no penalty or mask changes the logits. `grammar`:
        the tokens its rows may take, applied after every other processing (in place on `logits`
        when nothing else changed them and no row asks for logprobs, which come from the raw
        logits); the masked rows' argmax is taken afresh."""
        if logits.dim() != 2 or logits.shape[0] != len(batch):
            raise ValueError(
                f"Sampler: logits must be [{len(batch)}, vocab] (one row per request), got {tuple(logits.shape)}"
            )
        raw = logits.float()
        if len(batch) == 0:
            return SamplerOutput(torch.empty(0, dtype=torch.int64, device=logits.device), [])
        plan = _Plan.build(batch.params, raw.shape[1])
        # All-greedy batches without penalties (the common case) need no per-row upload.
        row = _RowTensors.build(batch.params, plan, raw.device) if plan.needs_rows else None
        processed = apply_min_new_tokens(apply_logit_bias(self._penalise(raw, batch, plan, row), batch), batch)
        argmax = argmax if processed is raw else None
        if grammar is not None:
            if processed is raw and any(p.logprobs is not None for p in batch.params):
                processed = raw.clone()
            grammar.apply(processed)
            argmax = None if argmax is None else grammar.patch_argmax(processed, argmax)
        token_ids = self._choose(processed, batch, plan, row, argmax)
        return SamplerOutput(token_ids, self._logprobs(raw, token_ids, batch))

    @staticmethod
    def _penalise(logits: torch.Tensor, batch: SamplingBatch, plan: _Plan, row: _RowTensors | None) -> torch.Tensor:
        vocab, device = logits.shape[1], logits.device
        if not (plan.any_presence_frequency or plan.any_repetition):
            return logits
        # Rows without a penalty contribute no tokens: uploading every prompt each
        # step is the expensive part, and their penalties are no-ops anyway.
        needs_output = [r or pf for r, pf in zip(plan.repetition, plan.presence_frequency)]
        output_counts = token_counts(_only(batch.output_token_ids, needs_output), vocab, device)
        if plan.any_repetition:
            prompt_seen = token_counts(_only(batch.prompt_token_ids, plan.repetition), vocab, device) > 0
            logits = apply_repetition_penalty(logits, prompt_seen | (output_counts > 0), row.repetition)
        if plan.any_presence_frequency:
            logits = apply_presence_frequency_penalties(logits, output_counts, row.presence, row.frequency)
        return logits

    @staticmethod
    def _choose(logits: torch.Tensor, batch: SamplingBatch, plan: _Plan, row: _RowTensors | None,
                argmax: torch.Tensor | None = None) -> torch.Tensor:
        all_greedy, any_greedy = all(plan.greedy), any(plan.greedy)
        if all_greedy:
            return _greedy(logits, argmax)
        scaled = apply_temperature(logits, row.temperature)
        top_p_rows = None
        if 0 < len(plan.top_p_rows) < len(batch):
            top_p_rows = _to_device(plan.top_p_rows, torch.int64, logits.device)
        filtered = apply_top_k_top_p_min_p(
            scaled,
            top_k=row.top_k if plan.any_top_k else None,
            top_p=row.top_p if plan.top_p_rows else None,
            min_p=row.min_p if plan.any_min_p else None,
            max_top_k=max(plan.top_k),
            top_p_rows=top_p_rows,
        )
        sampled = sample_tokens(filtered, batch.generators, skip=plan.greedy)
        if not any_greedy:
            return sampled
        greedy_rows = _to_device(plan.greedy, torch.bool, logits.device)
        return torch.where(greedy_rows, _greedy(logits, argmax), sampled)

    @staticmethod
    def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch) -> list[dict[int, float] | None]:
        wanted = [i for i, p in enumerate(batch.params) if p.logprobs is not None]
        result: list[dict[int, float] | None] = [None] * len(batch)
        if not wanted:
            return result
        if len(wanted) == len(batch):
            rows, chosen = raw, token_ids
        else:
            index = _to_device(wanted, torch.int64, raw.device)
            rows, chosen = raw.index_select(0, index), token_ids.index_select(0, index)
        ks = [batch.params[i].logprobs for i in wanted]
        for i, entries in zip(wanted, batch_top_logprobs(compute_logprobs(rows), ks, chosen)):
            result[i] = entries
        return result
