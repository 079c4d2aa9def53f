"""Prefix-cache policies: what KV a sequence keeps when a new request is attached to it.

One interface, two implementations (``--prefix-cache``):

- ``LlamaCachePolicy`` (llama-server): each sequence keeps its last request's KV; a sequence is picked by
  longest common token prefix (``get_available_slot``); when the adapter set changes,
  ``lora_should_clear_cache`` decides whether the sequence's cache survives.
- ``KeyedCachePolicy`` (ours): finished prefixes go to a shared ``PrefixCache`` keyed by the
  adapter-set fingerprint (content hashes + scales), so A→B→A finds A's prefix again.

Either way a cached position is reused only if the adapter set the new request uses at that
position computed it.
"""

from __future__ import annotations

from typing import Protocol

from worker.config import PrefixCachePolicy
from worker.lora.adapter_set import AdapterSet
from worker.runtime.kv_cache import KVStore
from worker.serving.prefix_store import PrefixCache
from worker.serving.request import GenRequest
from worker.serving.sequences import Seq, common_prefix_len


def lora_should_clear_cache(current: AdapterSet, nxt: AdapterSet) -> bool:
    """llama-server's rule when a sequence's adapter set changes: keep the cache only when the
    current set is empty or all-aLoRA **and** the next set is all-aLoRA (an empty set is not
    all-aLoRA). Source: tools/server ``lora_should_clear_cache``."""
    if current == nxt:
        return False
    keep = (current.is_empty() or current.all_alora()) and nxt.all_alora()
    return not keep


class CachePolicy(Protocol):
    """How a scheduler picks a sequence for a request and what KV the request may reuse."""

    name: str

    def pick_seq(self, free: list[Seq], req: GenRequest) -> Seq:
        """One of ``free`` (non-empty) for ``req``."""
        ...

    def attach(self, seq: Seq, req: GenRequest, kv: KVStore) -> int:
        """Prepare ``seq``'s KV sequence for ``req``; returns the positions reused (the KV
        sequence holds exactly those afterwards). Records cache telemetry on ``req``."""
        ...

    def on_finish(self, seq: Seq, req: GenRequest, kv: KVStore) -> None:
        """``req`` finished on ``seq`` (normally or cancelled)."""
        ...


class LlamaCachePolicy:
    """llama-server's per-slot prompt cache (one per sequence) with ``lora_should_clear_cache``."""

    name = PrefixCachePolicy.LLAMA.value

    def pick_seq(self, free: list[Seq], req: GenRequest) -> Seq:
        """The idle sequence whose cached tokens share the longest prefix with the prompt (tokens
        only: the adapter rule is applied in ``attach``), else the least recently used."""
        best = max(free, key=lambda s: (common_prefix_len(s.cache_tokens, req.prompt), -s.last_used))
        if common_prefix_len(best.cache_tokens, req.prompt) > 0:
            return best
        return min(free, key=lambda s: s.last_used)

    def attach(self, seq: Seq, req: GenRequest, kv: KVStore) -> int:
        cur = seq.last_set
        if seq.cache_tokens and cur is not None and lora_should_clear_cache(cur, req.adapter_set):
            req.telemetry.cache_cleared = True
            req.telemetry.cache_clear_reason = (
                f"adapter set changed ({cur.fingerprint} -> {req.adapter_set.fingerprint}): lora_should_clear_cache"
            )
            seq.drop_cache()
        n = 0 if req.params.prompt_logprobs else seq.cached_prefix_for(req)
        kv.seq_rm(seq.id, n)  # n == 0 drops the whole sequence
        return n

    def on_finish(self, seq: Seq, req: GenRequest, kv: KVStore) -> None:
        """The sequence keeps its KV for the next request."""


class KeyedCachePolicy:
    """Prefixes stored in a shared ``PrefixCache`` under the fingerprint that computed them."""

    name = PrefixCachePolicy.KEYED.value

    def __init__(self, store: PrefixCache):
        self.store = store

    def pick_seq(self, free: list[Seq], req: GenRequest) -> Seq:
        """Least recently used (the cache is shared, so any sequence will do)."""
        return min(free, key=lambda s: s.last_used)

    def attach(self, seq: Seq, req: GenRequest, kv: KVStore) -> int:
        kv.seq_rm(seq.id)
        if req.params.prompt_logprobs:
            return 0
        limit = len(req.prompt) - 1
        if req.activation.start >= 0:
            limit = min(limit, req.activation.start)  # positions >= start use another set
        n, entry = self.store.lookup(req.activation.pre_set.fingerprint, req.prompt, limit)
        if entry is None or n == 0:
            return 0
        kv.import_(seq.id, entry.kv, n)
        return n

    def on_finish(self, seq: Seq, req: GenRequest, kv: KVStore) -> None:
        """Save the cacheable prefix under the fingerprint that computed it, free the sequence."""
        n = seq.n_past
        start = req.activation.start
        if start >= 0:
            n, st = min(n, start), req.activation.pre_set
        else:
            st = req.adapter_set
        if n > 0 and kv.seq_len(seq.id) >= n:
            self.store.store(st.fingerprint, seq.cache_tokens[:n], kv.export(seq.id, n))
        kv.seq_rm(seq.id)
        seq.drop_cache()


def make_cache_policy(policy: PrefixCachePolicy, store: PrefixCache) -> CachePolicy:
    """The policy object for ``--prefix-cache``."""
    if policy == PrefixCachePolicy.LLAMA:
        return LlamaCachePolicy()
    return KeyedCachePolicy(store)


__all__ = ["CachePolicy", "KeyedCachePolicy", "LlamaCachePolicy", "lora_should_clear_cache", "make_cache_policy"]
