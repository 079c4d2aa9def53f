"""The activated-LoRA (aLoRA) rule: where in a prompt an aLoRA starts to apply.

An aLoRA carries ``adapter.alora.invocation_tokens``; it applies from the last occurrence of
that sequence in the prompt onwards (PEFT's activation point, which the adapters are trained
on; llama-server starts one token earlier). Tokens before it are computed without the aLoRA,
so their KV can be shared with requests that do not use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.errors import InvalidRequestError
from worker.lora.adapter_set import AdapterSet


@dataclass(frozen=True)
class AloraActivation:
    """Result of the aLoRA rule for one request.

    ``start`` = index of the first token computed with the adapter (-1: no aLoRA active);
    ``pre_set`` = the set used for tokens before ``start`` (the full set without the aLoRA).
    """

    adapter_set: AdapterSet
    pre_set: AdapterSet
    start: int


def find_last(tokens: list[int], needle: tuple[int, ...]) -> int:
    """Index of the last occurrence of ``needle`` in ``tokens`` (reverse scan), or -1."""
    n = len(needle)
    for s in range(len(tokens) - n, -1, -1):
        if tuple(tokens[s : s + n]) == needle:
            return s
    return -1


def resolve_alora(adapter_set: AdapterSet, prompt: list[int]) -> AloraActivation:
    """Apply the aLoRA rule (PEFT's activation point, which the adapters are trained on).

    For each enabled aLoRA, reverse-scan the prompt for its invocation sequence. Not found →
    that adapter is dropped (scale 0) for this request. Found at ``s`` → tokens ``0..s-1`` are
    computed without it and ``s..`` with it (llama-server starts at ``s-1``).

    Raises:
        InvalidRequestError: more than one enabled aLoRA in the request.
    """
    aloras = [(i, a) for i, a, _ in adapter_set.entries if a.alora_invocation_tokens]
    if not aloras:
        return AloraActivation(adapter_set, adapter_set, -1)
    if len(aloras) > 1:
        names = ", ".join(f"{i} ('{a.name}')" for i, a in aloras)
        raise InvalidRequestError(
            f"more than one activated LoRA (aLoRA) enabled in one request: adapters {names}; enable at most one"
        )
    aid, adapter = aloras[0]
    s = find_last(prompt, tuple(adapter.alora_invocation_tokens))
    without = adapter_set.without([aid])
    if s < 0:
        return AloraActivation(without, without, -1)
    return AloraActivation(adapter_set, without, s)


__all__ = ["AloraActivation", "find_last", "resolve_alora"]
