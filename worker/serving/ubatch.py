"""Ubatch assembly: which rows of which sequences go into the next decode (a pure function).

llama-server ``update_slots``: generating sequences feed one row each; prompt sequences feed chunks of
their prompt within the ``n_batch`` row budget. ``compat`` batching (llama.cpp's rule) only
puts sequences with the same next adapter set in one ubatch — groups take turns, the group whose
sequence waited longest going first — and splits a prompt at its aLoRA activation point; ``mixed``
batching takes every busy sequence and gives each row an index into the ubatch's adapter sets
(the LoRA routing input of the graph).
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.lora.adapter_set import AdapterSet
from worker.runtime.context_base import UBatch
from worker.serving.sequences import Seq, SeqState

N_BATCH = 512  # most token rows in one ubatch (llama.cpp n_batch / n_ubatch)


@dataclass(frozen=True)
class AssembledBatch:
    """A ubatch and where its rows came from.

    Attributes:
        parts: (sequence, positions it feeds) in row order.
        ubatch: the rows (token, pos, seq id, wants logits, set index).
        sets: the distinct adapter sets, ordered by fingerprint; ``ubatch.set_index`` indexes it.
    """

    parts: list[tuple[Seq, list[int]]]
    ubatch: UBatch
    sets: list[AdapterSet]


def compat_group(busy: list[Seq]) -> list[Seq]:
    """The sequences batchable with the one that waited longest (``Seq.can_batch_with``)."""
    oldest = min(busy, key=lambda s: (s.last_step, s.id))
    return [s for s in busy if s.can_batch_with(oldest)]


def rows_for(seq: Seq, budget: int, compat: bool) -> list[int]:
    """Positions ``seq`` feeds next: one when generating, else up to ``budget`` prompt
    positions (in compat mode stopping at the aLoRA activation point)."""
    req = seq.request
    if seq.state == SeqState.GENERATING:
        return [seq.n_past]
    end = min(len(req.prompt), seq.n_past + budget)
    s = req.activation.start
    if compat and s > seq.n_past:
        end = min(end, s)  # one adapter set per ubatch: split at the activation point
    return list(range(seq.n_past, end))


def assemble_ubatch(busy: list[Seq], *, compat: bool, n_batch: int = N_BATCH) -> AssembledBatch:
    """Build the next ubatch from the busy sequences (reads them, changes nothing).

    Generating sequences first (one row each), then prompt sequences while the ``n_batch`` budget
    lasts. Logits are wanted for the last prompt row, every generated row, and every prompt
    row of a request asking for prompt log-probs.
    """
    chosen = compat_group(busy) if compat else busy
    gen = [s for s in chosen if s.state == SeqState.GENERATING]
    prm = [s for s in chosen if s.state == SeqState.PROMPT]
    budget = n_batch - len(gen)
    parts: list[tuple[Seq, list[int]]] = []
    for s in gen + prm:
        rows = rows_for(s, max(budget, 1), compat)
        if s.state == SeqState.PROMPT:
            budget -= len(rows)
        if rows:
            parts.append((s, rows))
        if budget <= 0 and s.state == SeqState.PROMPT:
            break
    sets: list[AdapterSet] = []
    tokens: list[int] = []
    pos: list[int] = []
    seqs: list[int] = []
    want: list[bool] = []
    row_sets: list[AdapterSet] = []
    for s, rows in parts:
        req = s.request
        for p in rows:
            st = req.set_at(p)
            if st not in sets:
                sets.append(st)
            tokens.append(req.token_at(p))
            pos.append(p)
            seqs.append(s.id)
            want.append(p >= len(req.prompt) - 1 or req.params.prompt_logprobs)
            row_sets.append(st)
    sets.sort(key=lambda st: st.fingerprint)
    index = {st: i for i, st in enumerate(sets)}
    return AssembledBatch(parts, UBatch(tokens, pos, seqs, want, [index[st] for st in row_sets]), sets)


__all__ = ["N_BATCH", "AssembledBatch", "assemble_ubatch", "compat_group", "rows_for"]
