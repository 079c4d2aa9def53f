"""Token sampling and log-probs (vLLM ``SamplingParams`` semantics).

Log-probs are always those of the raw model distribution (``log_softmax(logits)``) before any
temperature / top-k / top-p — what llama-server returns with ``post_sampling_probs: false``
and vLLM's default. Sampling: greedy when ``temperature == 0``; otherwise
``softmax(logits / T)``, cut to the top-k tokens, then to the smallest nucleus with
cumulative probability ≥ top_p, and drawn with a per-request ``torch.Generator`` so a fixed
seed gives the same tokens every time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
        ignore_eos: do not stop at end-of-generation tokens.
        stop: stop strings (OpenAI ``stop``): generation ends once the generated text contains
            one; the text is cut before it (``worker.serving.output.StopMatcher``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int = 0
    prompt_logprobs: bool = False
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()

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
        if not 0 <= self.logprobs <= 20:
            raise SamplingError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must not be empty")
        return self


@dataclass(frozen=True)
class SampledToken:
    """The chosen token, its raw log-prob, and the top-N ``(token_id, logprob)`` pairs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


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

    def sample(
        self, logits: torch.Tensor, *, logp: torch.Tensor | None = None, argmax: int | None = None
    ) -> SampledToken:
        """Pick a token from f32 logits ``(n_vocab,)``.

        ``logp`` (this row's ``log_softmax``) and ``argmax`` may be passed when the caller
        computed them for many rows at once (``greedy_rows``); the result is the same.
        """
        logits = logits.float().cpu()
        if logp is None:
            logp = torch.log_softmax(logits, dim=-1)
        p = self.params
        if p.temperature == 0.0:
            tok = int(torch.argmax(logits)) if argmax is None else argmax
        else:
            scaled = logits / p.temperature
            if p.top_k > 0 and p.top_k < scaled.numel():
                kth = torch.topk(scaled, p.top_k).values[-1]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            probs = torch.softmax(scaled, dim=-1)
            if p.top_p < 1.0:
                sp, si = torch.sort(probs, descending=True)
                cum = torch.cumsum(sp, dim=0)
                drop = (cum - sp) >= p.top_p  # keep the smallest prefix reaching top_p
                sp = sp.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(0, si, sp)
            tok = int(torch.multinomial(probs, 1, generator=self.gen))
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs > 0:
            v, i = torch.topk(logp, p.logprobs)
            top = tuple((int(a), float(b)) for a, b in zip(i.tolist(), v.tolist(), strict=False))
        return SampledToken(tok, float(logp[tok]), top)


def greedy_rows(logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, list[int]]:
    """``log_softmax`` and argmax of the logits rows ``rows`` of f32 ``(m, n_vocab)`` in one
    batched op each (one pass over the ubatch instead of one per sequence); per row the
    values equal ``Sampler.sample``'s own (same ops, same reduction per row).

    Returns ``(logp (len(rows), n_vocab), argmax ids)``.
    """
    sel = logits.float().cpu().index_select(0, torch.tensor(rows, dtype=torch.long))
    return torch.log_softmax(sel, dim=-1), sel.argmax(dim=-1).tolist()


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int]) -> list[float]:
    """Log-prob of ``next_tokens[j]`` under ``logits[j]`` (f32 ``(m, n_vocab)``): the
    teacher-forced score of a prompt (entry j is prompt token j+1 given tokens 0..j)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(next_tokens, dtype=torch.long, device=lp.device).unsqueeze(1)
    return lp.gather(1, idx).squeeze(1).tolist()
