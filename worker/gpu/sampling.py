"""Sampling on the device: one batch of logits rows in, one packed tensor out (one device→host
copy per step).

The CPU sampler's semantics (``worker.runtime.sampling``), row by row, every per-row parameter a
tensor (`SamplingRows`, `SamplingTensors`): the grammar mask (`apply_bitmask`), log-probs of the
masked raw logits, penalties (`penalize`, from per-sequence token counts kept on the device in
`SamplingState`), greedy argmax, temperature / top-k / min-p / top-p, and a seeded draw by
inverse CDF from a counter-based generator (`counter_uniform`). `SamplingPlan` skips the stages
no row uses; `SamplingPlan.full` runs all of them with no data-dependent op, as a captured CUDA
graph needs.

The stages in order and their exact rules: docs/gpu.md, "Inside the GPU engine" (Sampling).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from worker.runtime.grammar import mask_words
from worker.runtime.sampling import MAX_LOGPROBS, SampledToken, SamplingParams

_M32 = 0xFFFFFFFF
UNCONSTRAINED = -1
"""A bitmask word with every bit set: the row allows every token of the word."""


# ------------------------------------------------------------------ generator


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` and a 32-bit constant ``c``, in two
    16-bit halves so no int64 product overflows."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (the "lowbias32" constants): every output bit depends on every
    input bit; int64 values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform number in ``[0, 1 - 2**-24]`` per row from int64 ``seeds`` and ``counters``
    ``(B,)``: f32 ``(B,)``, a pure function of each ``(seed, counter)`` pair (a counter-based
    generator, the idea of Philox: no state moves but the counter, so it runs inside a captured
    graph and a row's numbers do not depend on the other rows). 24 bits: the resolution of the
    f32 cumulative sums it is compared with."""
    h = _mix32((seeds & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seeds >> 32) & _M32))
    h = _mix32(h ^ (counters & _M32))
    h = _mix32(h ^ ((counters >> 32) & _M32))
    return (h >> 8).to(torch.float32) * (2.0**-24)


# ------------------------------------------------------------------ per-sequence state


class SamplingState:
    """Per-sequence sampling state on the device, one row per sequence id plus a scratch row
    (`scratch_row`) that padded batch rows read and write.

    Attributes:
        seeds: int64 ``(max_seqs + 1,)``, each sequence's generator seed.
        counters: int64 ``(max_seqs + 1,)``, tokens each sequence has sampled (the generator's
            counter).
        output_counts: int32 ``(max_seqs + 1, n_vocab)``, occurrences of each token in the
            sequence's output; None without ``penalties``.
        prompt_mask: bool ``(max_seqs + 1, n_vocab)``, the token occurs in the prompt; None
            without ``penalties``.

    Args:
        penalties: keep the token counts (``(max_seqs + 1) * n_vocab * 5`` bytes); without them
            a plan with penalties raises.
    """

    def __init__(self, *, max_seqs: int, n_vocab: int, device: torch.device, penalties: bool = True):
        self.max_seqs, self.n_vocab, self.device = max_seqs, n_vocab, device
        self.scratch_row = max_seqs
        with torch.inference_mode():
            self.seeds = torch.zeros((max_seqs + 1,), dtype=torch.int64, device=device)
            self.counters = torch.zeros((max_seqs + 1,), dtype=torch.int64, device=device)
            self.output_counts: torch.Tensor | None = None
            self.prompt_mask: torch.Tensor | None = None
            if penalties:
                self.output_counts = torch.zeros((max_seqs + 1, n_vocab), dtype=torch.int32, device=device)
                self.prompt_mask = torch.zeros((max_seqs + 1, n_vocab), dtype=torch.bool, device=device)

    @torch.inference_mode()
    def start(self, seq: int, *, seed: int | None, prompt: Sequence[int] = ()) -> None:
        """Reset sequence ``seq`` for a new request: its seed (None: a random one; any integer,
        taken modulo 2**64 as the CPU sampler does), counter 0, no output tokens, and the
        prompt's tokens for the repetition penalty (ids outside the vocabulary are ignored).

        Raises:
            ValueError: ``seq`` is not in ``0..max_seqs-1``.
        """
        if not 0 <= seq < self.max_seqs:
            raise ValueError(f"sampling state: seq {seq} is not in 0..{self.max_seqs - 1}")
        value = secrets.randbits(64) if seed is None else int(seed) & 0xFFFF_FFFF_FFFF_FFFF
        self.seeds[seq] = value - (1 << 64) if value >= 1 << 63 else value  # the int64 of those bits
        self.counters[seq] = 0
        if self.output_counts is not None and self.prompt_mask is not None:
            self.output_counts[seq].zero_()
            self.prompt_mask[seq].zero_()
            ids = torch.tensor([t for t in prompt if 0 <= t < self.n_vocab], dtype=torch.long)
            if ids.numel():
                self.prompt_mask[seq].index_fill_(0, ids.to(self.device), True)

    def uniform(self, seq_ids: torch.Tensor) -> torch.Tensor:
        """This step's uniform number of each row (`counter_uniform`), f32 ``(B,)``."""
        return counter_uniform(self.seeds.index_select(0, seq_ids), self.counters.index_select(0, seq_ids))

    @torch.inference_mode()
    def record(self, seq_ids: torch.Tensor, tokens: torch.Tensor, *, count_tokens: bool) -> None:
        """Account the tokens ``tokens`` int64 ``(B,)`` sampled by rows of sequences ``seq_ids``
        int64 ``(B,)``: every counter moves on; with ``count_tokens`` the output counts too.
        Device ops only (no host sync)."""
        self.counters.index_add_(0, seq_ids, torch.ones_like(seq_ids))
        if count_tokens and self.output_counts is not None:
            flat = seq_ids * self.n_vocab + tokens
            self.output_counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))


# ------------------------------------------------------------------ per-row parameters


@dataclass
class SamplingRows:
    """A step's per-row sampling parameters on the host (numpy, one entry per row).

    Attributes:
        temperature, top_p, min_p, presence, frequency, repetition: f32 ``(B,)``.
        top_k: int32 ``(B,)``.
        seq_ids: int64 ``(B,)``, the `SamplingState` row of each batch row.
        masks: int32 ``(B, mask_words(n_vocab))`` grammar bitmasks, `UNCONSTRAINED` words on
            unconstrained rows; None: no row is constrained.
        n_logprobs: top log-probs each row asks for.
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    repetition: np.ndarray
    seq_ids: np.ndarray
    masks: np.ndarray | None
    n_logprobs: list[int]

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], seq_ids: Sequence[int], masks: np.ndarray | None = None
    ) -> SamplingRows:
        """The rows of requests with (validated) ``params`` on sequences ``seq_ids``."""

        def col(name: str, dtype: type) -> np.ndarray:
            return np.array([getattr(p, name) for p in params], dtype=dtype)

        return cls(
            temperature=col("temperature", np.float32),
            top_k=col("top_k", np.int32),
            top_p=col("top_p", np.float32),
            min_p=col("min_p", np.float32),
            presence=col("presence_penalty", np.float32),
            frequency=col("frequency_penalty", np.float32),
            repetition=col("repetition_penalty", np.float32),
            seq_ids=np.asarray(seq_ids, dtype=np.int64),
            masks=masks,
            n_logprobs=[p.logprobs for p in params],
        )

    def plan(self) -> SamplingPlan:
        """The stages these rows need."""
        drawing = self.temperature > 0
        cut = (self.top_k > 0) | (self.top_p < 1)
        penalized = (self.presence != 0) | (self.frequency != 0) | (self.repetition != 1)
        return SamplingPlan(
            draw=bool(drawing.any()),
            sort=bool((drawing & cut).any()),
            penalties=bool(penalized.any()),
            masks=self.masks is not None and bool((self.masks != UNCONSTRAINED).any()),
            n_logprobs=max(self.n_logprobs, default=0),
        )


@dataclass(frozen=True)
class SamplingPlan:
    """Which stages a step runs (host-side flags, decided when the batch is assembled).

    Attributes:
        draw: some row has ``temperature > 0``.
        sort: some drawing row has a top-k or top-p cut.
        penalties: some row has a penalty on.
        masks: some row is constrained by a grammar.
        n_logprobs: top log-probs packed per row (the largest any row asks for).
    """

    draw: bool
    sort: bool
    penalties: bool
    masks: bool
    n_logprobs: int

    @classmethod
    def full(cls, n_logprobs: int = MAX_LOGPROBS) -> SamplingPlan:
        """Every stage: the data-independent op sequence a captured graph runs."""
        return cls(draw=True, sort=True, penalties=True, masks=True, n_logprobs=n_logprobs)


@dataclass
class SamplingTensors:
    """`SamplingRows` on the device (same fields, torch tensors, rows first)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    seq_ids: torch.Tensor
    masks: torch.Tensor

    @staticmethod
    def pads(scratch_row: int) -> dict[str, float | int]:
        """Each field's value on padded rows: greedy, no cut, no penalty, unconstrained, and the
        state's scratch row."""
        return dict(
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            presence=0.0,
            frequency=0.0,
            repetition=1.0,
            seq_ids=scratch_row,
            masks=UNCONSTRAINED,
        )

    @classmethod
    def empty(cls, n_rows: int, n_vocab: int, device: torch.device) -> SamplingTensors:
        """Uninitialized buffers for ``n_rows`` rows (static inputs of captured graphs)."""
        dtypes = _DTYPES
        out = {}
        with torch.inference_mode():
            for f in fields(cls):
                shape = (n_rows, mask_words(n_vocab)) if f.name == "masks" else (n_rows,)
                out[f.name] = torch.empty(shape, dtype=dtypes[f.name], device=device)
        return cls(**out)

    @classmethod
    def from_rows(cls, rows: SamplingRows, n_vocab: int, device: torch.device) -> SamplingTensors:
        """``rows`` copied to ``device`` (one copy per field; masks all `UNCONSTRAINED` when None)."""
        n = len(rows.seq_ids)
        masks = rows.masks if rows.masks is not None else np.full((n, mask_words(n_vocab)), UNCONSTRAINED, np.int32)
        out = {}
        for f in fields(cls):
            value = masks if f.name == "masks" else getattr(rows, f.name)
            out[f.name] = torch.from_numpy(np.ascontiguousarray(value)).to(device=device, dtype=_DTYPES[f.name])
        return cls(**out)

    def rows(self, n: int) -> SamplingTensors:
        """Views of the first ``n`` rows."""
        return SamplingTensors(**{f.name: getattr(self, f.name)[:n] for f in fields(self)})


_DTYPES = dict(
    temperature=torch.float32,
    top_k=torch.int32,
    top_p=torch.float32,
    min_p=torch.float32,
    presence=torch.float32,
    frequency=torch.float32,
    repetition=torch.float32,
    seq_ids=torch.int64,
    masks=torch.int32,
)


# ------------------------------------------------------------------ stages


def apply_bitmask(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``logits`` f32 ``(B, n_vocab)`` with ``-inf`` wherever int32 ``masks`` ``(B, W)`` (``W =
    mask_words(n_vocab)``) has a clear bit; a new tensor. Bits past ``n_vocab`` are ignored."""
    n_vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    bits = (masks.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: & 1 keeps bit 31 right
    allowed = bits.flatten(1)[:, :n_vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def penalize(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalized copy of f32 ``logits`` ``(B, n_vocab)`` with the CPU rule and arithmetic
    (``worker.runtime.sampling.penalize_rows``): where the token is in the prompt
    (bool ``prompt_mask`` ``(B, n_vocab)``) or the output (int32 ``output_counts`` ``(B,
    n_vocab)`` > 0), ``logit / r`` when positive else ``logit * r``; then ``logit - (f * count +
    p)`` where ``count > 0``. ``presence``, ``frequency``, ``repetition``: f32 ``(B,)``. Neutral
    values (r 1, p and f 0) leave a row bit for bit unchanged."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.unsqueeze(1)
    out = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    counts = output_counts.to(logits.dtype)
    present = (output_counts > 0).to(logits.dtype)
    return out - (frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * present)


def _scale(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``(logits - max) / T`` per row (the same softmax as ``logits / T``); NaN counts as
    ``-inf``, and a row whose max is not finite (a ``+inf`` logit, or no finite one) keeps only
    its argmax (the CPU ``_scale`` rule). ``temperature`` f32 ``(B,)``, > 0."""
    clean = torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    top = clean.amax(dim=-1, keepdim=True)
    scaled = (clean - top) / temperature.unsqueeze(1)
    only_top = torch.full_like(clean, float("-inf")).scatter_(1, clean.argmax(dim=-1, keepdim=True), 0.0)
    return torch.where(torch.isfinite(top), scaled, only_top)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Rows of ``probs`` without tokens below ``min_p`` × the row's largest, renormalized; rows
    with ``min_p == 0`` unchanged (the CPU ``_min_p_cut``)."""
    kept = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), 0.0)
    return torch.where((min_p > 0).unsqueeze(1), kept / kept.sum(dim=-1, keepdim=True), probs)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row the index ``j`` where the cumulative sum of ``probs`` ``(B, n)`` (≥ 0, any
    total) first exceeds ``u * total`` (``u`` f32 ``(B,)`` in ``[0, 1)``): a draw from
    ``probs / total``. A zero-probability answer (rounding at the very end) falls back to the
    row's most likely entry. int64 ``(B,)``."""
    cum = probs.cumsum(dim=-1)
    x = (u * cum[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cum, x, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
    ok = probs.gather(1, idx.unsqueeze(1)).squeeze(1) > 0
    return torch.where(ok, idx, probs.argmax(dim=-1))


def _draw(logits: torch.Tensor, t: SamplingTensors, u: torch.Tensor, *, sort: bool) -> torch.Tensor:
    """Temperature, top-k, min-p, top-p and the draw for every row of the penalized ``logits``
    ``(B, n_vocab)`` (greedy rows draw too, at temperature 1; the caller discards them)."""
    n_vocab = logits.shape[1]
    scaled = _scale(logits, torch.where(t.temperature > 0, t.temperature, 1.0))
    k = t.top_k.long()
    k = torch.where((k > 0) & (k < n_vocab), k, n_vocab)
    if sort:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))  # ties with the k-th stay
    probs = _min_p(torch.softmax(scaled, dim=-1), t.min_p)
    tok = _inverse_cdf(probs, u)
    if sort:
        sorted_probs = probs.gather(1, order)
        cum = sorted_probs.cumsum(dim=-1)
        drop = ((cum - sorted_probs) >= t.top_p.unsqueeze(1)) & (t.top_p < 1).unsqueeze(1)
        idx = _inverse_cdf(sorted_probs.masked_fill(drop, 0.0), u)
        cut = (k < n_vocab) | (t.top_p < 1)
        tok = torch.where(cut, order.gather(1, idx.unsqueeze(1)).squeeze(1), tok)
    return tok


@torch.inference_mode()
def sample(logits: torch.Tensor, t: SamplingTensors, state: SamplingState, plan: SamplingPlan) -> torch.Tensor:
    """Sample one token per row of ``logits`` ``(B, n_vocab)`` (any float dtype; computed in
    f32) with the rows' parameters ``t`` (``B`` rows) and advance ``state`` (module docstring
    for the stages). Device ops only, no host sync: with `SamplingPlan.full` it may run inside a
    captured graph.

    ``plan`` must cover the rows (`SamplingRows.plan`, or `SamplingPlan.full`): a stage it
    skips is skipped for every row.

    Returns:
        int32 ``(B, 2 + 2 * N)`` with ``N = min(plan.n_logprobs, n_vocab)``: the token id, its
        log-prob's f32 bits, N top token ids (descending), their log-probs' f32 bits (`unpack`
        reads it on the host).

    Raises:
        ValueError: the plan has penalties and ``state`` keeps no token counts.
    """
    if plan.penalties and (state.output_counts is None or state.prompt_mask is None):
        raise ValueError("a plan with penalties needs a SamplingState with penalties=True")
    x = logits.float()
    if plan.masks:
        x = apply_bitmask(x, t.masks)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    pen = x
    if plan.penalties:
        assert state.output_counts is not None and state.prompt_mask is not None
        counts = state.output_counts.index_select(0, t.seq_ids)
        seen = state.prompt_mask.index_select(0, t.seq_ids)
        pen = penalize(x, counts, seen, t.presence, t.frequency, t.repetition)
    tok = pen.argmax(dim=-1)
    if plan.draw:
        tok = torch.where(t.temperature > 0, _draw(pen, t, state.uniform(t.seq_ids), sort=plan.sort), tok)
    parts = [tok.to(torch.int32).unsqueeze(1), (x.gather(1, tok.unsqueeze(1)) - lse).view(torch.int32)]
    n_top = min(plan.n_logprobs, x.shape[1])
    if n_top:
        top_logits, top_ids = x.topk(n_top, dim=-1)
        parts += [top_ids.to(torch.int32), (top_logits - lse).view(torch.int32)]
    state.record(t.seq_ids, tok, count_tokens=plan.penalties)
    return torch.cat(parts, dim=1)


def fetch(packed: torch.Tensor) -> np.ndarray:
    """The step's one device→host copy: `sample`'s output as a numpy int32 array."""
    return packed.cpu().numpy()


def unpack(packed: np.ndarray, n_logprobs: Sequence[int]) -> list[SampledToken]:
    """`SampledToken` per row of `sample`'s output (on the host, `fetch`), with the first
    ``n_logprobs[i]`` top log-probs of row ``i`` (at most what the plan packed)."""
    floats = packed.view(np.float32)
    n_top = (packed.shape[1] - 2) // 2
    out = []
    for i, n in enumerate(n_logprobs):
        n = min(n, n_top)
        top = tuple(zip(packed[i, 2 : 2 + n].tolist(), floats[i, 2 + n_top : 2 + n_top + n].tolist(), strict=True))
        out.append(SampledToken(int(packed[i, 0]), float(floats[i, 1]), top))
    return out


__all__ = [
    "UNCONSTRAINED",
    "SamplingPlan",
    "SamplingRows",
    "SamplingState",
    "SamplingTensors",
    "apply_bitmask",
    "counter_uniform",
    "fetch",
    "penalize",
    "sample",
    "unpack",
]
