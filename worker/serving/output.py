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
    return [(int(t), float(v)) for t, v in zip(next_tokens, vals)]


def finish_reason(token_id: int, *, eog_ids: frozenset[int], ignore_eos: bool, n_generated: int,
                  max_tokens: int, n_past: int, n_ctx: int) -> str | None:
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


__all__ = ["IncrementalDetokenizer", "finish_reason", "prompt_token_logprobs"]
