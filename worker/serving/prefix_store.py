"""Adapter-keyed prefix cache (policy ``keyed``; beyond llama.cpp).

Entries are keyed by ``(adapter_set.fingerprint, token prefix)``: the fingerprint is made from
adapter *content* hashes and scales (``AdapterSet.key``), never names or ids, so KV computed
under one set can only ever serve that same set, and switching A→B→A finds A's prefix again.
(llama-server's prompt cache holds tokens only, with no adapter identity, which is why it
must clear on every switch.) Eviction is LRU by token count.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from worker.runtime.kv_cache import KVSnapshot
from worker.serving.sequences import common_prefix_len


@dataclass
class PrefixEntry:
    """A cached prefix: the adapter-set fingerprint that computed it, its tokens, its KV."""

    fingerprint: str
    tokens: tuple[int, ...]
    kv: KVSnapshot


class PrefixCache:
    """LRU store of KV snapshots keyed by ``(fingerprint, tokens)``.

    Args:
        max_tokens: total cached positions kept before the least recently used go.
    """

    def __init__(self, max_tokens: int = 65536):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], PrefixEntry] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hit_tokens = 0
        self.lookups = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def n_tokens(self) -> int:
        """Cached positions over every entry."""
        return self._tokens

    def lookup(self, fingerprint: str, prompt: list[int], limit: int) -> tuple[int, PrefixEntry | None]:
        """Longest cached prefix of ``prompt`` computed under ``fingerprint``, at most ``limit``
        positions. Returns ``(n, entry)``; ``(0, None)`` on a miss."""
        best_n, best = 0, None
        with self._lock:
            self.lookups += 1
            for _key, e in self._entries.items():
                if e.fingerprint != fingerprint:
                    continue
                n = common_prefix_len(e.tokens, prompt, limit)
                if n > best_n:
                    best_n, best = n, e
            if best is not None:
                self._entries.move_to_end((best.fingerprint, best.tokens))
                self.hit_tokens += best_n
        return best_n, best

    def store(self, fingerprint: str, tokens: list[int], kv: KVSnapshot) -> None:
        """Insert (or refresh) an entry; drops entries that are a prefix of it, then evicts LRU."""
        if not tokens:
            return
        key = (fingerprint, tuple(tokens))
        with self._lock:
            for k in [
                k
                for k, e in self._entries.items()
                if e.fingerprint == fingerprint and len(e.tokens) <= len(tokens) and e.tokens == key[1][: len(e.tokens)]
            ]:
                self._tokens -= len(self._entries.pop(k).tokens)
            self._entries[key] = PrefixEntry(fingerprint, key[1], kv)
            self._tokens += len(tokens)
            while self._tokens > self.max_tokens and len(self._entries) > 1:
                _, old = self._entries.popitem(last=False)
                self._tokens -= len(old.tokens)
