"""Ubatch assembly: which rows of which slots go into the next decode (a pure function).

llama-server ``update_slots``: generating slots feed one row each; prompt slots feed chunks of
their prompt within the ``n_batch`` row budget. ``compat`` batching (llama.cpp's rule) only
puts slots with the same next adapter set in one ubatch — groups take turns, the group whose
slot waited longest going first — and splits a prompt at its aLoRA activation point; ``mixed``
batching takes every busy slot and gives each row an index into the ubatch's adapter sets
(the LoRA routing input of the graph).
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.lora.adapter_set import AdapterSet
from worker.runtime.context import UBatch
from worker.serving.slots import Slot, SlotState

N_BATCH = 512  # most token rows in one ubatch (llama.cpp n_batch / n_ubatch)


@dataclass(frozen=True)
class UBatchPlan:
    """A ubatch and where its rows came from.

    Attributes:
        parts: (slot, positions it feeds) in row order.
        ubatch: the rows (token, pos, seq id, wants logits, set index).
        sets: the distinct adapter sets, ordered by fingerprint; ``ubatch.set_index`` indexes it.
    """

    parts: list[tuple[Slot, list[int]]]
    ubatch: UBatch
    sets: list[AdapterSet]


def compat_group(busy: list[Slot]) -> list[Slot]:
    """The slots batchable with the one that waited longest (``Slot.can_batch_with``)."""
    oldest = min(busy, key=lambda s: (s.last_step, s.id))
    return [s for s in busy if s.can_batch_with(oldest)]


def rows_for(slot: Slot, budget: int, compat: bool) -> list[int]:
    """Positions ``slot`` feeds next: one when generating, else up to ``budget`` prompt
    positions (in compat mode stopping at the aLoRA activation point)."""
    req = slot.request
    if slot.state == SlotState.GENERATING:
        return [slot.n_past]
    end = min(len(req.prompt), slot.n_past + budget)
    s = req.activation.start
    if compat and s > slot.n_past:
        end = min(end, s)  # one adapter set per ubatch: split at the activation point
    return list(range(slot.n_past, end))


def assemble_ubatch(busy: list[Slot], *, compat: bool, n_batch: int = N_BATCH) -> UBatchPlan:
    """Build the next ubatch from the busy slots (reads them, changes nothing).

    Generating slots first (one row each), then prompt slots while the ``n_batch`` budget
    lasts. Logits are wanted for the last prompt row, every generated row, and every prompt
    row of a request asking for prompt log-probs.
    """
    chosen = compat_group(busy) if compat else busy
    gen = [s for s in chosen if s.state == SlotState.GENERATING]
    prm = [s for s in chosen if s.state == SlotState.PROMPT]
    budget = n_batch - len(gen)
    parts: list[tuple[Slot, list[int]]] = []
    for s in gen + prm:
        rows = rows_for(s, max(budget, 1), compat)
        if s.state == SlotState.PROMPT:
            budget -= len(rows)
        if rows:
            parts.append((s, rows))
        if budget <= 0 and s.state == SlotState.PROMPT:
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
    return UBatchPlan(parts, UBatch(tokens, pos, seqs, want, [index[st] for st in row_sets]), sets)


__all__ = ["N_BATCH", "UBatchPlan", "assemble_ubatch", "compat_group", "rows_for"]
