"""Token sampling and log-probs (vLLM ``SamplingParams`` semantics).

`SamplingParams` holds one request's parameters (checked; `SamplingError`); `Sampler` samples a
step's rows: penalties on the raw logits (`apply_penalties`' rule, applied by `penalize_rows`),
greedy rows by argmax (`greedy_rows`), else temperature, min-p, top-k, top-p and a seeded draw.
Log-probs are those of the raw distribution, before penalties and cuts (`prompt_logprobs` for
prompt tokens; at most `MAX_LOGPROBS` top entries). On CPU the per-row summary comes from the
fused C kernel (`summarize_rows`, ``worker.runtime.kernels.sample.logits_summary``); torch runs
it for CUDA logits and ``LORAPLANE_KERNELS=torch``. The GPU engine's sampler
(``worker.gpu.sampling``) keeps these semantics.

The order of the steps and what log-probs report: docs/http-api.md, "Request parameters"
(Sampling order).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from loraplane.response_format import ResponseFormat
from worker.runtime.kernels.cpu import resolve_path
from worker.runtime.kernels.sample import TOPK_MAX, logits_summary

MAX_LOGPROBS = 20  # the most top log-probs a request may ask for (SamplingParams.logprobs)


class SamplingError(ValueError):
    """A sampling parameter is out of range (names the field)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling.

    Attributes:
        max_tokens: tokens to generate (≥ 1).
        temperature: 0 → greedy.
        top_k: 0 → no cut.
        top_p: in (0, 1]; 1 → no cut.
        seed: None → nondeterministic.
        logprobs: top-N log-probs returned per generated token (0..20).
        prompt_logprobs: return each prompt token's log-prob given its prefix.
        prompt_logprobs_top: with ``prompt_logprobs``, the N most likely tokens at each prompt
            position too (0..20; vLLM ``prompt_logprobs`` = N).
        ignore_eos: do not stop at end-of-generation tokens.
        stop: stop strings (OpenAI ``stop``): generation ends once the generated text contains
            one; the text is cut before it (``worker.serving.output.StopMatcher``).
        min_p: in [0, 1]; drop tokens whose probability (after temperature) is below
            ``min_p`` × the most likely token's (vLLM / llama.cpp ``min_p``); 0 → off.
        presence_penalty: in [-2, 2]; subtracted from the logit of every token the output
            holds (OpenAI / vLLM); 0 → off.
        frequency_penalty: in [-2, 2]; subtracted once per occurrence in the output; 0 → off.
        repetition_penalty: > 0; a token of the prompt or the output has its logit divided by
            it when positive, multiplied when not (HF / vLLM, CTRL paper); 1 → off.
        response_format: structured output: the grammar the output must match
            (``loraplane.response_format.ResponseFormat``); None: unconstrained.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int = 0
    prompt_logprobs: bool = False
    prompt_logprobs_top: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    response_format: ResponseFormat | None = None

    @property
    def penalized(self) -> bool:
        """Whether any of the penalties is on (`apply_penalties` runs for this request)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> SamplingParams:
        """Raises SamplingError naming the first bad field."""
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 0 <= self.prompt_logprobs_top <= MAX_LOGPROBS:
            raise SamplingError(f"prompt_logprobs_top must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs_top}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must not be empty")
        if not 0.0 <= self.min_p <= 1.0:  # NaN fails too
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise SamplingError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        return self


@dataclass(frozen=True)
class SampledToken:
    """The chosen token, its raw log-prob, and the top-N ``(token_id, logprob)`` pairs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _fused_path(logits: torch.Tensor) -> str | None:
    """The C path of ``logits_summary`` for these logits, or None for the torch path (CUDA
    logits, ``LORAPLANE_KERNELS=torch``, a CPU without AVX2).

    Raises:
        KernelPathError: ``LORAPLANE_KERNELS`` names a path this CPU cannot run.
    """
    if logits.device.type != "cpu":
        return None
    path = resolve_path()
    return None if path == "torch" else path


@dataclass(frozen=True)
class RowSummary:
    """One logits row's fused summary (``worker.runtime.kernels.sample.logits_summary``):
    everything greedy sampling, the chosen token's log-prob and the top log-probs need, without
    a full ``log_softmax`` row.

    Attributes:
        max: the row's largest logit.
        logsum: ``log(sum_j exp(x_j - max))``; ``log_softmax(x)_j = (x_j - max) - logsum`` (f32).
        top_ids: token ids of the largest logits, descending, equal logits by ascending id
            (``top_ids[0]`` is the argmax, the first maximum like ``torch.argmax``).
        top_logits: f32 ``(len(top_ids),)``, their logits.
    """

    max: float
    logsum: float
    top_ids: list[int]
    top_logits: torch.Tensor

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """``log_softmax`` of the f32 logits ``logits`` (any shape) of this row, in f32."""
        return (logits.float() - self.max) - self.logsum


# What a batched pre-computation hands ``Sampler.sample`` for one row: the row's full
# ``log_softmax`` (torch path) or its fused summary (C path).
RowLogprobs = torch.Tensor | RowSummary


def summarize_rows(logits: torch.Tensor, k: int, path: str, rows: list[int] | None = None) -> list[RowSummary]:
    """Fused summaries of the rows ``rows`` (None: all) of f32 CPU ``logits`` ``(m, n_vocab)``
    with the top-``k`` (``k`` clamped to ``[1, min(TOPK_MAX, n_vocab)]``); one C call for all
    rows, read in place."""
    k = max(1, min(k, TOPK_MAX, logits.shape[-1]))
    s = logits_summary(logits, k, rows=rows, path=path)
    mx, ls, ids = s.max.tolist(), s.logsum.tolist(), s.top_ids.tolist()
    return [RowSummary(mx[i], ls[i], ids[i], s.top_logits[i]) for i in range(len(mx))]


class Sampler:
    """Samples one sequence's tokens; holds its random generator."""

    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self.gen = torch.Generator(device="cpu")
        if params.seed is not None:
            self.gen.manual_seed(int(params.seed) & 0xFFFF_FFFF_FFFF_FFFF)
        else:
            self.gen.seed()

    @property
    def greedy(self) -> bool:
        """Whether this sampler takes the argmax (``temperature == 0``)."""
        return self.params.temperature == 0.0

    def _top_needed(self, n_vocab: int) -> int:
        """Entries of the fused top list this sampler needs: its top log-probs, and for a
        top-k cut ``top_k + 8`` (room for logits tied with the k-th; a last entry still tied
        shows that ties may run past the list)."""
        p = self.params
        k = max(1, p.logprobs)
        if not self.greedy and 0 < p.top_k < n_vocab and p.top_k + 1 <= TOPK_MAX:
            k = max(k, min(p.top_k + 8, TOPK_MAX))
        return k

    def sample(
        self,
        logits: torch.Tensor,
        *,
        logp: RowLogprobs | None = None,
        argmax: int | None = None,
        penalized: torch.Tensor | None = None,
    ) -> SampledToken:
        """Pick a token from f32 logits ``(n_vocab,)``.

        ``logp`` (this row's ``log_softmax`` tensor, or its ``RowSummary``) and ``argmax`` may
        be passed when the caller computed them for many rows at once (``greedy_rows``); the
        result is the same (a summary must hold at least ``params.logprobs`` top entries).

        ``penalized``: the row after `apply_penalties` (``(n_vocab,)``, `penalize_rows`): the
        token is chosen from it (greedy: its argmax; ``argmax`` is then ignored), the log-probs
        still come from the raw ``logits`` (vLLM's raw log-probs). A penalized row that samples
        takes the full-vocabulary torch draw.

        On CPU with the C kernels (``resolve_path()`` not 'torch') the row is summarized by
        the fused kernel (``logits_summary``: max, log-sum-exp, top-k in one pass) instead of
        ``log_softmax`` + ``argmax`` + ``topk``: greedy ids are the same (first maximum),
        log-probs agree with torch's f32 ``log_softmax`` to ~1e-5 (tests). A top-k cut
        (``0 < top_k < TOPK_MAX``) then samples from the top-k candidates only; without one the
        full-vocabulary torch draw is kept (top-p alone needs the whole distribution).

        Raises:
            KernelPathError: ``LORAPLANE_KERNELS`` names a path this CPU cannot run.
        """
        logits = logits.float()
        p = self.params
        if logp is None:
            path = _fused_path(logits)
            if path is not None:
                k = self._top_needed(logits.numel()) if penalized is None else max(1, p.logprobs)
                logp = summarize_rows(logits.unsqueeze(0), k, path)[0]
        logits = logits.cpu()
        if penalized is not None:
            pen = penalized.float().cpu()
            tok = int(torch.argmax(pen)) if self.greedy else self._draw_full(pen)
            if isinstance(logp, RowSummary):
                return self._summary_result(tok, logits, logp)
            return self._full_result(tok, logits, logp)
        if isinstance(logp, RowSummary):
            return self._sample_summary(logits, logp, argmax)
        if p.temperature == 0.0:
            tok = int(torch.argmax(logits)) if argmax is None else argmax
        else:
            tok = self._draw_full(logits)
        return self._full_result(tok, logits, logp)

    def _full_result(self, tok: int, logits: torch.Tensor, logp: torch.Tensor | None) -> SampledToken:
        """``tok`` with its raw log-prob and top log-probs from the row's ``log_softmax``
        (computed from ``logits`` when ``logp`` is None)."""
        if logp is None:
            logp = torch.log_softmax(logits, dim=-1)
        n_top = self.params.logprobs
        top: tuple[tuple[int, float], ...] = ()
        if n_top > 0:
            v, i = torch.topk(logp, n_top)
            top = tuple((int(a), float(b)) for a, b in zip(i.tolist(), v.tolist(), strict=False))
        return SampledToken(tok, float(logp[tok]), top)

    def _summary_result(self, tok: int, logits: torch.Tensor, s: RowSummary) -> SampledToken:
        """``tok`` with its raw log-prob and top log-probs from the row's fused summary."""
        n_top = self.params.logprobs
        top: tuple[tuple[int, float], ...] = ()
        if n_top > 0:
            lp = s.logprobs(s.top_logits[:n_top]).tolist()
            top = tuple(zip(s.top_ids[:n_top], lp, strict=True))
        return SampledToken(tok, float(s.logprobs(logits[tok])), top)

    def _draw_full(self, logits: torch.Tensor) -> int:
        """Temperature, top-k, min-p, top-p over the whole vocabulary and a draw (the torch path)."""
        p = self.params
        scaled = _scale(logits, p.temperature)
        if p.top_k > 0 and p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = _min_p_cut(torch.softmax(scaled, dim=-1), p.min_p)
        if p.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            cum = torch.cumsum(sp, dim=0)
            drop = (cum - sp) >= p.top_p  # keep the smallest prefix reaching top_p
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, si, sp)
        return int(torch.multinomial(probs, 1, generator=self.gen))

    def _draw_candidates(self, s: RowSummary, n_vocab: int) -> int | None:
        """Temperature, top-k, min-p, top-p on the fused top list and a draw; None when the
        list cannot decide (no top-k cut, or logits tied with the k-th run past the list's end).

        The same distribution as ``_draw_full`` (every token with a scaled logit >= the k-th
        is kept, ties included; min-p relative to the first candidate, the most likely token;
        top-p on the kept tokens in descending order, equal ones by id), drawn over the
        candidates: a fixed seed gives the same tokens every time, but not the same tokens as
        the full-vocabulary draw.
        """
        p = self.params
        n = len(s.top_ids)
        if not (0 < p.top_k < n_vocab) or n <= p.top_k:
            return None
        scaled = _scale(s.top_logits, p.temperature)
        keep = scaled >= scaled[p.top_k - 1]
        if bool(keep[-1]) and n < n_vocab:
            return None  # ties with the k-th go past the list: the full path keeps them all
        scaled = scaled[keep]
        probs = _min_p_cut(torch.softmax(scaled, dim=-1), p.min_p)  # descending (scaled is)
        if p.top_p < 1.0:
            drop = (torch.cumsum(probs, dim=0) - probs) >= p.top_p  # smallest prefix reaching top_p
            probs = probs.masked_fill(drop, 0.0)
        return s.top_ids[int(torch.multinomial(probs, 1, generator=self.gen))]

    def _sample_summary(self, logits: torch.Tensor, s: RowSummary, argmax: int | None) -> SampledToken:
        p = self.params
        if p.temperature == 0.0:
            tok = s.top_ids[0] if argmax is None else argmax
        else:
            drawn = self._draw_candidates(s, logits.numel())
            tok = self._draw_full(logits) if drawn is None else drawn
        return self._summary_result(tok, logits, s)


def _min_p_cut(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """``probs`` (``(n,)``, summing to 1) without the tokens whose probability is below
    ``min_p`` × the largest, renormalized (vLLM ``MinPLogitsProcessor``: ``probs <
    min_p * max`` dropped; the most likely token always stays); ``min_p == 0``: unchanged."""
    if min_p <= 0.0:
        return probs
    kept = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return kept / kept.sum()


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalized copy of f32 ``logits`` ``(m, n_vocab)``, one request per row (vLLM
    ``vllm/model_executor/layers/utils.py`` ``apply_penalties``; HF ``RepetitionPenalty``):

    * repetition: where the token is in the row's prompt or output, ``logit / r`` when
      ``logit > 0``, else ``logit × r`` (``r == 1``: unchanged);
    * frequency: ``- f × count`` (occurrences in the output only);
    * presence: ``- p × [count > 0]`` (output only).

    Args:
        prompt_mask: bool ``(m, n_vocab)``, the token occurs in the row's prompt.
        output_counts: ``(m, n_vocab)`` occurrences of each token in the row's output so far.
        presence, frequency, repetition: f32 ``(m,)``, each row's penalties.
    """
    counts = output_counts.to(logits.dtype)
    seen = prompt_mask | (output_counts > 0)
    rep = torch.where(seen, repetition.unsqueeze(1), torch.ones((), dtype=logits.dtype, device=logits.device))
    out = torch.where(logits > 0, logits / rep, logits * rep)
    out = out - frequency.unsqueeze(1) * counts
    return out - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def penalize_rows(
    logits: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
) -> torch.Tensor:
    """The rows ``rows`` of f32 ``logits`` ``(m, n_vocab)`` after `apply_penalties`: ``(len(rows),
    n_vocab)`` f32 on the CPU, one copy of the selected rows. ``params[i]``, ``prompts[i]`` and
    ``outputs[i]`` (token ids so far) belong to ``rows[i]``; rows of a mixed batch carry
    different penalties.

    The same values as `apply_penalties` (tests compare them), computed sparsely: a penalty only
    moves the logits of tokens the row has seen, so per row only those are gathered, changed
    and scattered back (``torch.unique`` of its prompt and output ids; ids outside ``[0,
    n_vocab)`` are ignored). No pass over the vocabulary beyond the copy: with a 262k vocabulary
    the dense form costs tens of milliseconds per step for 16 rows, this well under one.
    """
    out = logits.float().cpu().index_select(0, torch.tensor(rows, dtype=torch.long))
    n_vocab = out.shape[1]
    for i, q in enumerate(params):
        row = out[i]
        produced = torch.tensor(outputs[i], dtype=torch.long)
        produced = produced[(produced >= 0) & (produced < n_vocab)]
        if q.repetition_penalty != 1.0:
            seen = torch.tensor(prompts[i], dtype=torch.long)
            seen = torch.unique(torch.cat([seen[(seen >= 0) & (seen < n_vocab)], produced]))
            v = row[seen]
            row[seen] = torch.where(v > 0, v / q.repetition_penalty, v * q.repetition_penalty)
        if (q.frequency_penalty != 0.0 or q.presence_penalty != 0.0) and produced.numel():
            ids, counts = torch.unique(produced, return_counts=True)
            row[ids] -= q.frequency_penalty * counts.to(row.dtype) + q.presence_penalty
    return out


def _scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` made safe to softmax and draw from (never NaN, never +inf).

    The fast path is the plain quotient. When it is not finite at the top: a tiny temperature
    (below ~1e-37 in f32) overflowed it, or the logits hold NaN or ±inf (an adapter at a huge
    scale drives activations past f32). Then NaN counts as -inf and the max-shifted form
    ``(logits - max) / temperature`` is used (the same softmax by shift invariance, 0 at the
    top and -inf elsewhere for tiny temperatures); a +inf logit, or no finite one at all,
    leaves only the argmax. Without this ``torch.multinomial`` raised on the scheduler thread,
    which ended scheduling for every request of the worker.
    """
    scaled = logits / temperature
    if bool(torch.isfinite(scaled.max())):  # max propagates NaN
        return scaled
    clean = torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    top = clean.max()
    if not bool(torch.isfinite(top)):
        only = torch.full_like(clean, float("-inf"))
        only[int(torch.argmax(clean))] = 0.0
        return only
    return (clean - top) / temperature


def greedy_top(samplers: Iterable[Sampler]) -> int:
    """The top-list length :func:`greedy_rows` needs for these greedy rows' samplers: the most
    top log-probs any of their requests asks for, at least 1 (the argmax)."""
    return max((max(1, sp.params.logprobs) for sp in samplers), default=1)


def greedy_rows(logits: torch.Tensor, rows: list[int], k: int = MAX_LOGPROBS) -> tuple[list[RowLogprobs], list[int]]:
    """Per-row log-prob data and argmax of the logits rows ``rows`` of f32 ``(m, n_vocab)``, all
    rows in one call (one pass over the ubatch instead of one per sequence); per row the
    values equal ``Sampler.sample``'s own.

    On CPU with the C kernels each row's entry is its ``RowSummary`` (fused max, log-sum-exp
    and the top ``k``: at least the most top log-probs any of these rows' requests asks for,
    default :data:`MAX_LOGPROBS`; keeping fewer candidates makes the pass cheaper, the values
    are the same); otherwise its ``log_softmax`` row ``(n_vocab,)``. Hand an entry to
    ``Sampler.sample(logp=...)``.

    Returns ``(per-row log-prob data, argmax ids)`` (argmax: first maximum).

    Raises:
        KernelPathError: ``LORAPLANE_KERNELS`` names a path this CPU cannot run.
    """
    path = _fused_path(logits)
    if path is not None:
        summ = summarize_rows(logits.float(), k, path, rows)
        return list(summ), [s.top_ids[0] for s in summ]
    sel = logits.float().cpu().index_select(0, torch.tensor(rows, dtype=torch.long))
    return list(torch.log_softmax(sel, dim=-1)), sel.argmax(dim=-1).tolist()


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int]) -> list[float]:
    """Log-prob of ``next_tokens[j]`` under ``logits[j]`` (f32 ``(m, n_vocab)``): the
    teacher-forced score of a prompt (entry j is prompt token j+1 given tokens 0..j)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(next_tokens, dtype=torch.long, device=lp.device).unsqueeze(1)
    return lp.gather(1, idx).squeeze(1).tolist()
