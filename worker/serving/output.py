"""Output handling: incremental detokenization, prompt log-probs, stop conditions.

Pure helpers the scheduler calls after each decode (llama-server ``process_token`` /
``populate_token_probs``; vLLM's incremental detokenizer). None of them touch slots or the KV
cache.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

import torch

from worker.runtime.tokenizer import Tokenizer


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
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        buf = self._held + text
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self._held = ""
            return buf[: min(found)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail (generation ended without a stop string)."""
        out, self._held = self._held, ""
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
    generated or the slot's context (``n_ctx`` positions) full — llama-server's
    ``has_budget`` / ``n_ctx`` checks.
    """
    if token_id in eog_ids and not ignore_eos:
        return "stop"
    if n_generated >= max_tokens or n_past + 1 >= n_ctx:
        return "length"
    return None


__all__ = ["IncrementalDetokenizer", "StopMatcher", "finish_reason", "prompt_token_logprobs"]
