"""Output handling: what a sequence's logits become for the client, after each decode.

``OutputStage`` is the one place that turns a request's logits rows into events: prompt
log-probs while the prompt is computed, then per generated token sample → record →
detokenize → stop strings → finish reason → ``TokenEvent`` (llama-server ``process_token`` /
``populate_token_probs``; vLLM's output processor with its incremental detokenizer and stop
checker). It and the helpers below never touch sequences or the KV cache: the scheduler keeps
that bookkeeping and ends the request when the stage gives a finish reason.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable, Sequence

import torch

from worker.runtime.sampling import RowLogprobs, Sampler
from worker.runtime.tokenizer import Tokenizer
from worker.serving.request import GenRequest, StartedEvent, StepInfo, TokenEvent


class IncrementalDetokenizer:
    """Text of a growing token sequence, one token at a time, in O(1) per token.

    Appends each token's bytes (``Tokenizer.token_bytes``) to an incremental UTF-8 decoder, so
    a multi-byte character split over byte tokens is emitted once it is complete. The
    concatenation of every ``push`` plus ``flush`` equals ``Tokenizer.decode`` of all tokens
    (same first-token space rule and BOS handling; tested).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._n = 0

    def push(self, token_id: int) -> str:
        """Feed one token; returns the text it completes ("" while a character is partial)."""
        tok = self._tok
        first = self._n == 0
        self._n += 1
        if first and tok.add_bos and token_id == tok.bos_id:
            return ""  # decode drops a leading BOS, and then removes no space
        piece = tok.token_bytes(token_id)
        if first and tok.add_space_prefix and piece.startswith(b" "):
            piece = piece[1:]
        return self._dec.decode(piece)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end becomes U+FFFD)."""
        return self._dec.decode(b"", final=True)


class StopMatcher:
    """Stop strings over streamed text (OpenAI / vLLM ``stop``).

    ``push(text)`` takes each newly detokenized piece and returns ``(text safe to emit, hit)``.
    On a hit the emitted text ends just before the earliest stop string and the request
    finishes with "stop" (the stop string itself is never returned, as in vLLM with
    ``include_stop_str_in_output=False``). Without a hit, a tail that could still grow into a
    stop string is held back, so streamed pieces never show text that a later token turns into
    a stop; ``flush()`` releases it when generation ends for another reason. The pieces
    returned, concatenated, are exactly the final text.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._tail = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Feed newly detokenized ``text``; returns ``(text safe to emit, stop string hit)``."""
        buf = self._tail + text
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self._tail = ""
            return buf[: min(found)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._tail = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail (generation ended without a stop string)."""
        out, self._tail = self._tail, ""
        return out


def prompt_token_logprobs(logits: torch.Tensor, next_tokens: Sequence[int]) -> list[tuple[int, float]]:
    """Log-prob of each next prompt token given its prefix (vLLM ``prompt_logprobs``).

    Args:
        logits: f32 ``(m, V)`` logits of ``m`` consecutive prompt rows.
        next_tokens: the ``m`` tokens that follow those rows.

    Returns:
        ``[(token id, log-prob)]`` of length ``m``.
    """
    if len(next_tokens) == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(list(next_tokens), dtype=torch.long, device=lp.device)
    vals = lp.gather(1, idx.unsqueeze(1)).squeeze(1).tolist()
    return [(int(t), float(v)) for t, v in zip(next_tokens, vals, strict=False)]


def finish_reason(
    token_id: int,
    *,
    eog_ids: frozenset[int],
    ignore_eos: bool,
    n_generated: int,
    max_tokens: int,
    n_past: int,
    n_ctx: int,
) -> str | None:
    """Why generation stops after ``token_id``, or None to continue.

    "stop": an end-of-generation token (unless ``ignore_eos``); "length": ``max_tokens``
    generated or the sequence's context (``n_ctx`` positions) full — llama-server's
    ``has_budget`` / ``n_ctx`` checks.
    """
    if token_id in eog_ids and not ignore_eos:
        return "stop"
    if n_generated >= max_tokens or n_past + 1 >= n_ctx:
        return "length"
    return None


class OutputStage:
    """Turns one request's logits rows into its events (module docstring).

    Args:
        tokenizer: the model's tokenizer (end-of-generation ids, final text).
        n_ctx_slot: KV positions of a sequence; generation stops ("length") before it is full.
    """

    def __init__(self, tokenizer: Tokenizer, n_ctx_slot: int):
        self.tokenizer = tokenizer
        self.n_ctx_slot = n_ctx_slot

    def prompt_rows(self, req: GenRequest, rows: Sequence[int], logits: torch.Tensor, out_idx: Sequence[int]) -> None:
        """Record the prompt log-probs of computed prompt positions ``rows`` (only when the
        request asked for them; vLLM ``prompt_logprobs``).

        Args:
            req: the request; its ``prompt_logprobs`` grows by one entry per row whose next
                token is a prompt token.
            rows: the positions computed, consecutive.
            logits: f32 ``(n_out, n_vocab)`` of the ubatch's output rows.
            out_idx: per position of ``rows``, its row in ``logits``.
        """
        if not req.params.prompt_logprobs:
            return
        n_prompt = len(req.prompt)
        m = sum(1 for p in rows if p + 1 < n_prompt)
        if m:
            req.prompt_logprobs += prompt_token_logprobs(
                logits[list(out_idx[:m])], [req.prompt[p + 1] for p in rows[:m]]
            )

    def started(self, req: GenRequest) -> StartedEvent:
        """The event of a request whose prompt is computed (prompt log-probs: None for token 0,
        then one per token; the list is None unless asked for)."""
        plp = [None, *req.prompt_logprobs] if req.params.prompt_logprobs else None
        return StartedEvent(list(req.prompt), plp)

    def token(
        self,
        req: GenRequest,
        sampler: Sampler,
        logits_row: torch.Tensor,
        *,
        n_past: int,
        step: StepInfo,
        pre: tuple[RowLogprobs, int] | None = None,
        on_token: Callable[[GenRequest, float], None] | None = None,
    ) -> tuple[TokenEvent, str | None]:
        """Sample one token for ``req`` and produce its event and finish reason.

        Samples from ``logits_row`` (f32 ``(n_vocab,)``; ``pre``: this row's batched
        ``(log_softmax, argmax)`` for a greedy sampler, ``greedy_rows``), records it on the
        request (token times, ``generated``, step telemetry), detokenizes it incrementally,
        decides the finish reason (``finish_reason``: end of generation, ``max_tokens`` or the
        sequence's context full; "stop" also when a stop string completes) and cuts the text at a
        stop string (``StopMatcher``: held-back text is flushed when generation ends for
        another reason). ``on_token(req, now)`` is called before the token's time is recorded
        (``req.last_token_at`` still holds the previous token's).

        Args:
            n_past: positions in the KV sequence after this step.

        Returns:
            ``(TokenEvent, reason)``; reason None: generation continues.
        """
        if pre is not None:
            sampled = sampler.sample(logits_row, logp=pre[0], argmax=pre[1])
        else:
            sampled = sampler.sample(logits_row)
        now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
        if on_token is not None:
            on_token(req, now)
        req.last_token_at = now
        req.generated.append(sampled.token_id)
        req.telemetry.count_step(step)
        piece = req.detok.push(sampled.token_id)
        reason = finish_reason(
            sampled.token_id,
            eog_ids=self.tokenizer.eog_ids,
            ignore_eos=req.params.ignore_eos,
            n_generated=len(req.generated),
            max_tokens=req.params.max_tokens,
            n_past=n_past,
            n_ctx=self.n_ctx_slot,
        )
        if req.stop is not None:
            piece, hit = req.stop.push(piece)
            if hit:
                reason = "stop"
            elif reason is not None:
                piece += req.stop.push(req.detok.flush())[0] + req.stop.flush()
            req.text_out.append(piece)
        return TokenEvent(sampled.token_id, piece, sampled.logprob, sampled.top, step), reason

    def final_text(self, req: GenRequest) -> str:
        """The whole generated text of a finished request: the pieces emitted (cut at a stop
        string) when it has stop strings, else the tokenizer's decode of every token."""
        return "".join(req.text_out) if req.stop is not None else self.tokenizer.decode(req.generated)


__all__ = ["IncrementalDetokenizer", "OutputStage", "StopMatcher", "finish_reason", "prompt_token_logprobs"]
