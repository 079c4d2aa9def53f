"""The host tier of adapters: which ids a worker may serve, which it holds validated, and
their files (vLLM's ``WorkerLoRAManager`` with ``max_cpu_loras``; llama.cpp has no such tier).

`HostCache` keeps the first two of the three tiers: *known* ids (`KnownAdapter`: sha256, name,
pin flag, from ``LoadAdapter`` or an announcement) and the *host* tier, validated and
file-backed adapters in the model's registry (``ModelAdapters.by_id``), at most ``capacity``,
LRU; it reads the *device* tier (``worker.lora.pool``) and changes it only in ``forget``, on the
thread that owns the pool. `fetch_to_file` fetches bytes by sha256 into the worker's cache
directory (`CACHE_DIR_PREFIX`; `remove_stale_cache_dirs` removes dead workers' ones).
``start_drain`` refuses new requests for an id; the owner calls ``forget`` once none holds it.
Locking: one lock guards the tables; ``in_use`` and ``set_pinned`` are called with it held, so
they must not call back into this object.

The tiers, eviction and local files: docs/architecture.md, "Three tiers on a worker".
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from loraplane.formats.adapter_file import AdapterError
from worker.errors import AdapterConflictError, AdapterFetchError, AdapterNotFoundError, InvalidRequestError
from worker.lora.adapter import LoraAdapter, LoraPair
from worker.lora.adapter_set import AdapterSet
from worker.lora.pool import LoraPool
from worker.lora.registry import ModelAdapters

log = structlog.get_logger("loraplane.worker.lora.host_cache")

Fetcher = Callable[[str], Iterator[bytes]]
"""sha256 → the adapter's bytes in chunks (``worker.rpc.fetch.ControlPlaneFetcher``); raises
``AdapterFetchError`` (``not_found`` when the control plane has no such content)."""


@dataclass
class KnownAdapter:
    """An adapter id this worker may serve: content hash, name, pin, and where its bytes are
    (``path`` empty: fetch from the control plane by sha256)."""

    sha256: str
    name: str
    path: str = ""
    pinned: bool = False


@dataclass
class HostCounters:
    """Monotonic counters of the host tier (reported in ``WorkerStats``): fetches from the
    control plane (bytes, failures), validations into the host tier, entries dropped."""

    fetches: int = 0
    fetch_bytes: int = 0
    fetch_failures: int = 0
    host_loads: int = 0
    host_evictions: int = 0


CACHE_DIR_PREFIX = "loraplane-worker-adapters-"
"""Cache directories are ``<tempdir>/loraplane-worker-adapters-<pid>-<random>``."""
_CACHE_DIR_NAME = re.compile(re.escape(CACHE_DIR_PREFIX) + r"([0-9]+)-[^/]+\Z")


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists and is not a zombie (signal 0; one we may not signal
    exists too; ``/proc/<pid>/stat`` state ``Z`` is a dead process not yet reaped)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust the signal
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def remove_stale_cache_dirs(parent: str | Path | None = None) -> list[Path]:
    """Remove the adapter cache directories under ``parent`` (default: the temp directory)
    whose owning worker process is gone (the pid in the name is not alive), as left by a
    worker killed without cleanup. A directory whose pid now belongs to another process is
    kept (it may be a live worker's); errors are logged, never raised.

    Returns:
        The directories removed.
    """
    root = Path(tempfile.gettempdir() if parent is None else parent)
    removed: list[Path] = []
    try:
        entries = list(root.iterdir())
    except OSError as exc:
        log.warning("stale_cache_scan_failed", dir=str(root), error=str(exc))
        return removed
    for entry in entries:
        m = _CACHE_DIR_NAME.match(entry.name)
        if m is None or int(m.group(1)) == os.getpid() or pid_alive(int(m.group(1))):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink() and entry.stat().st_uid == os.getuid():
                shutil.rmtree(entry)
                removed.append(entry)
                log.info("stale_adapter_cache_removed", path=str(entry), pid=int(m.group(1)))
        except OSError as exc:
            log.warning("stale_adapter_cache_not_removed", path=str(entry), error=str(exc))
    return removed


def fetch_to_file(fetcher: Fetcher, adapter_id: int, sha256: str, target: Path) -> int:
    """Stream ``fetcher(sha256)`` into ``target`` through a temporary file, keeping it only if
    the bytes hash to ``sha256``; returns the byte count.

    Raises:
        AdapterFetchError: the fetcher failed (its ``not_found`` kept, the adapter id added to
            the message), or a hash mismatch; no file is left behind either way.
    """
    h = hashlib.sha256()
    tmp = target.with_suffix(f".part-{uuid.uuid4().hex[:8]}")
    n = 0
    try:
        with open(tmp, "wb") as f:
            for piece in fetcher(sha256):
                h.update(piece)
                f.write(piece)
                n += len(piece)
    except AdapterFetchError as exc:
        tmp.unlink(missing_ok=True)
        raise AdapterFetchError(
            f"adapter {adapter_id}: fetching sha256 {sha256} from the control plane failed: {exc}",
            not_found=exc.not_found,
        ) from exc
    if h.hexdigest() != sha256:
        tmp.unlink(missing_ok=True)
        raise AdapterFetchError(
            f"adapter {adapter_id}: fetched bytes hash to {h.hexdigest()}, expected sha256 {sha256} (hash mismatch)"
        )
    os.replace(tmp, target)
    return n


class HostCache:
    """Known adapters, the host tier (LRU, bounded), draining, loads in flight, the cache dir.

    Safe from any thread. Requests bring their adapters to host with ``get`` on their own
    thread (off the decode loop).

    Args:
        adapters: the model's registry; its ``by_id`` is the host tier, its ``pool`` the slots.
        open_adapter: path → validated, file-backed ``LoraAdapter`` (raises ``AdapterError``).
        capacity: host entries kept (``max(--max-cpu-loras, --max-loras)``).
        max_lora_rank: largest rank accepted (``--max-lora-rank``).
        in_use: adapter id → whether a request holds it (the scheduler's request holds);
            such an entry is never dropped.
        set_pinned: ``(sha256, pinned)`` → apply the pin flag in the pool (the caller defers
            it to the pool's owner thread).
        worker_id: named in error messages.
        on_loaded: called after each validation into the host tier (a metric).
    """

    def __init__(
        self,
        adapters: ModelAdapters,
        *,
        open_adapter: Callable[[str], LoraAdapter],
        capacity: int,
        max_lora_rank: int,
        in_use: Callable[[int], bool],
        set_pinned: Callable[[str, bool], None],
        worker_id: str,
        on_loaded: Callable[[], None] = lambda: None,
    ) -> None:
        self._registry = adapters
        self._by_id = adapters.by_id
        self._pool = adapters.pool
        self._open = open_adapter
        self.capacity = capacity
        self.max_lora_rank = max_lora_rank
        self._in_use = in_use
        self._set_pinned_in_pool = set_pinned
        self.worker_id = worker_id
        self._on_loaded = on_loaded
        self.fetcher: Fetcher | None = None
        self.counters = HostCounters()
        self._lock = threading.Lock()
        self._known: dict[int, KnownAdapter] = {}
        self._lru: dict[int, None] = {}  # host entries, least recently used first
        self._draining: set[int] = set()
        self._loads: dict[str, concurrent.futures.Future[LoraAdapter]] = {}  # by sha256
        # The pid in the name tells operators (and tests) whose directory it is, and lets the
        # next worker remove it when this process died without `close` (kill -9, OOM kill).
        remove_stale_cache_dirs()
        self.cache_dir = Path(tempfile.mkdtemp(prefix=f"{CACHE_DIR_PREFIX}{os.getpid()}-"))

    def close(self) -> None:
        """Remove the cache directory (its files are copies: the control plane keeps the
        originals)."""
        shutil.rmtree(self.cache_dir, ignore_errors=True)

    # --- snapshots ------------------------------------------------------------------------
    def known(self) -> dict[int, KnownAdapter]:
        """Every adapter id this worker may serve."""
        with self._lock:
            return dict(self._known)

    def host(self) -> dict[int, LoraAdapter]:
        """The host tier: adapters validated now."""
        with self._lock:
            return dict(self._by_id)

    def draining_ids(self) -> set[int]:
        """Adapters being unloaded: refused for new requests, freed once no request holds them."""
        with self._lock:
            return set(self._draining)

    # --- registration ---------------------------------------------------------------------
    def register(
        self,
        adapter_id: int,
        *,
        sha256: str = "",
        path: str = "",
        data: bytes = b"",
        name: str = "",
        fetch_on_demand: bool = False,
        pinned: bool | None = None,
    ) -> LoraAdapter | KnownAdapter:
        """Register an adapter under the id the control plane assigned.

        With ``data`` (written to the cache directory) or ``path`` it is validated into the
        host tier now. With ``fetch_on_demand`` only the id → sha256 mapping is recorded; the
        bytes are fetched when a request first needs them. ``pinned`` (None: unchanged) sets
        the pin flag either way.

        Returns:
            The host entry, or the ``KnownAdapter`` record (fetch on demand).

        Raises:
            InvalidRequestError: bad file, rank above ``max_lora_rank``, hash mismatch, no
                source given.
            AdapterConflictError: the id is held by different content.
            AdapterNotFoundError: no file at the path.
        """
        if fetch_on_demand and not data and not path:
            return self._register_header(adapter_id, sha256, name, pinned)
        if data:
            digest = hashlib.sha256(data).hexdigest()
            if sha256 and digest != sha256:
                raise InvalidRequestError(f"adapter {adapter_id}: sha256 mismatch (expected {sha256}, got {digest})")
            target = self.cache_dir / f"{digest}.gguf"
            target.write_bytes(data)
            path = str(target)
        elif not path:
            raise InvalidRequestError(f"adapter {adapter_id}: neither server_path nor data given")
        elif not os.path.isfile(path):
            raise AdapterNotFoundError(f"adapter {adapter_id}: no file at '{path}' on worker {self.worker_id}")
        with self._lock:
            held = self._by_id.get(adapter_id)
            known = self._known.get(adapter_id)
        if held is not None or (known is not None and known.path):
            have = held.sha256 if held is not None else known.sha256  # type: ignore[union-attr]
            if sha256 and have != sha256:
                raise AdapterConflictError(f"adapter id {adapter_id} is loaded with other content ({have})")
            if held is not None:
                return held
        adapter = self._read(adapter_id, path)
        if sha256 and adapter.sha256 != sha256:
            raise InvalidRequestError(
                f"adapter {adapter_id}: sha256 mismatch (expected {sha256}, got {adapter.sha256})"
            )
        with self._lock:
            known = self._known.get(adapter_id)
            if known is None or known.sha256 != adapter.sha256:
                known = self._known[adapter_id] = KnownAdapter(adapter.sha256, adapter.name, path)
            known.path = path
            adapter = self._put(adapter_id, adapter)
            self._draining.discard(adapter_id)
            if pinned is not None:
                self._pin(known, pinned)
            self._trim()
        log.info("adapter_loaded", adapter_id=adapter_id, name=adapter.name, pairs=len(adapter.pairs))
        return adapter

    def _register_header(self, adapter_id: int, sha256: str, name: str, pinned: bool | None) -> KnownAdapter:
        """Record id → sha256 only (fetch on demand).

        Raises:
            InvalidRequestError: no sha256.
            AdapterConflictError: the id is known with other content.
        """
        if not sha256:
            raise InvalidRequestError(f"adapter {adapter_id}: fetch_on_demand needs the sha256")
        with self._lock:
            known = self._known.get(adapter_id)
            if known is not None and known.sha256 != sha256:
                raise AdapterConflictError(f"adapter id {adapter_id} is loaded with other content ({known.sha256})")
            if known is None:
                known = self._known[adapter_id] = KnownAdapter(sha256, name or sha256[:12])
                self._draining.discard(adapter_id)
            if pinned is not None:
                self._pin(known, pinned)
        return known

    def _read(self, adapter_id: int, path: str) -> LoraAdapter:
        """Validate ``path`` into a file-backed adapter (any thread, no lock held).

        Raises:
            InvalidRequestError: the file fails validation or a rank exceeds ``max_lora_rank``.
        """
        try:
            adapter = self._open(path)
        except AdapterError as exc:
            raise InvalidRequestError(str(exc)) from exc
        too_big = max(adapter.ranks, default=0)
        if too_big > self.max_lora_rank:
            raise InvalidRequestError(
                f"adapter {adapter_id} ('{adapter.name}') has rank {too_big}, above this worker's "
                f"--max-lora-rank {self.max_lora_rank}"
            )
        with self._lock:
            self.counters.host_loads += 1
        self._on_loaded()  # every validation: eager, from a local file, or fetched
        return adapter

    def _pin(self, known: KnownAdapter, pinned: bool) -> None:
        """Record the pin flag and pass it to the pool (lock held)."""
        known.pinned = pinned
        self._set_pinned_in_pool(known.sha256, pinned)

    def _put(self, adapter_id: int, adapter: LoraAdapter) -> LoraAdapter:
        """Insert into the host tier as most recently used (lock held); an entry of the same
        content already there is kept (requests resolved to it stay valid). Returns the entry."""
        have = self._by_id.get(adapter_id)
        if have is None or have.sha256 != adapter.sha256:
            self._registry.add(adapter_id, adapter)
            have = adapter
        self._touch(adapter_id)
        return have

    def _touch(self, adapter_id: int) -> None:
        self._lru.pop(adapter_id, None)
        self._lru[adapter_id] = None

    def trim(self) -> None:
        """Drop host entries beyond ``capacity`` that may go (see ``_trim``)."""
        with self._lock:
            self._trim()

    def _trim(self) -> None:
        """Drop least recently used host entries beyond ``capacity`` that no request holds,
        that are not resident in a slot, not pinned and not draining (lock held); a dropped
        entry's copy in the cache directory goes too when a fetcher can give it again."""
        over = len(self._by_id) - self.capacity
        if over <= 0:
            return
        resident = self._pool.resident_shas()
        for aid in list(self._lru):
            if over <= 0:
                break
            a = self._by_id.get(aid)
            if a is None:
                self._lru.pop(aid, None)
                continue
            known = self._known.get(aid)
            if (
                a.sha256 in resident
                or (known is not None and known.pinned)
                or aid in self._draining
                or self._in_use(aid)
            ):
                continue
            del self._by_id[aid]
            self._lru.pop(aid, None)
            self.counters.host_evictions += 1
            over -= 1
            if self.fetcher is not None and not any(b.sha256 == a.sha256 for b in self._by_id.values()):
                (self.cache_dir / f"{a.sha256}.gguf").unlink(missing_ok=True)  # fetched again by sha256

    # --- serving --------------------------------------------------------------------------
    def get(self, adapter_id: int) -> tuple[LoraAdapter, str]:
        """The adapter's host entry and where it came from: "host" (already there), "loaded"
        (validated from its local file now) or "fetched" (bytes fetched from the control plane
        now, then validated).

        Runs on the caller's thread. One load per content at a time: concurrent callers for
        the same content wait for the first one's load (its error is theirs too). The caller
        holds a request hold on ``adapter_id`` first (``in_use`` true), so the entry stays in
        the host tier until the request is submitted and beyond.

        Raises:
            AdapterNotFoundError: the id is unknown or being unloaded.
            AdapterFetchError: the control plane could not give the bytes, or they (or the
                local file) do not hash to the registered sha256.
            InvalidRequestError: the file fails validation.
        """
        with self._lock:
            a = self._by_id.get(adapter_id)
            known = self._known.get(adapter_id)
            if a is not None:
                self._touch(adapter_id)
                return a, "host"
            if known is None or adapter_id in self._draining:
                raise AdapterNotFoundError(
                    f"adapter {adapter_id} is not loaded on worker {self.worker_id} "
                    f"(loaded: {sorted(i for i in self._known if i not in self._draining)})"
                )
            fut = self._loads.get(known.sha256)
            owner = fut is None
            if fut is None:
                fut = self._loads[known.sha256] = concurrent.futures.Future()
        if not owner:
            fut.result()  # the first caller's load
            return self.get(adapter_id)  # a host hit now, or loaded again if dropped since
        try:
            adapter, source = self._load(adapter_id, known)
            fut.set_result(adapter)
            return adapter, source
        except BaseException as exc:
            fut.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._loads.pop(known.sha256, None)

    def _load(self, adapter_id: int, known: KnownAdapter) -> tuple[LoraAdapter, str]:
        """Validate the adapter from its file, fetching the bytes first when there is none.

        Raises:
            AdapterFetchError, InvalidRequestError: as ``get``.
        """
        source = "loaded"
        path = known.path
        cached = self.cache_dir / f"{known.sha256}.gguf"
        if not path or not os.path.isfile(path):
            if not cached.is_file():
                self._fetch(adapter_id, known.sha256, cached)
                source = "fetched"
            path = str(cached)
        try:
            adapter = self._read_verified(adapter_id, path, known.sha256)
        except (InvalidRequestError, AdapterFetchError) as exc:
            # A local copy (fetched, or written from LoadAdapter bytes) that no longer reads or
            # hashes right — corrupted or cut on disk — is fetched again once by its sha256.
            if source == "fetched" or self.fetcher is None or Path(path) != cached:
                raise
            log.warning("adapter_copy_bad_refetching", adapter_id=adapter_id, path=path, error=str(exc))
            cached.unlink(missing_ok=True)
            self._fetch(adapter_id, known.sha256, cached)
            source = "fetched"
            adapter = self._read_verified(adapter_id, path, known.sha256)
        with self._lock:
            if adapter_id in self._known:
                adapter = self._put(adapter_id, adapter)
                self._trim()
        return adapter, source

    def _read_verified(self, adapter_id: int, path: str, sha256: str) -> LoraAdapter:
        """``_read``, then check the file hashes to ``sha256``.

        Raises:
            InvalidRequestError: as ``_read``.
            AdapterFetchError: the file hashes to something else.
        """
        adapter = self._read(adapter_id, path)
        if adapter.sha256 != sha256:
            raise AdapterFetchError(
                f"adapter {adapter_id}: file '{path}' hashes to {adapter.sha256}, registered as {sha256}"
            )
        return adapter

    def discard_bad_copy(self, adapter_id: int) -> bool:
        """Drop the host entry of ``adapter_id`` (and every id with the same content) and its
        local copy in the cache directory, after that copy failed to re-read at page-in
        (deleted or changed on disk), so that the next ``get`` fetches it again. Files under
        ``--adapter-dir`` are never touched.

        Returns:
            True when something was discarded and a fetcher can give the bytes again (retry the
            request's adapters once); False otherwise (fail the request).
        """
        with self._lock:
            a = self._by_id.get(adapter_id)
            if a is None or a.source is None or self.fetcher is None:
                return False
            copy = self.cache_dir / f"{a.sha256}.gguf"
            if Path(a.source.path) != copy:
                return False
            for aid in [i for i, b in self._by_id.items() if b.sha256 == a.sha256]:
                del self._by_id[aid]
                self._lru.pop(aid, None)
            copy.unlink(missing_ok=True)
        log.warning("adapter_copy_bad_discarded", adapter_id=adapter_id, path=str(copy))
        return True

    def _fetch(self, adapter_id: int, sha256: str, target: Path) -> None:
        """Fetch the bytes of ``sha256`` from the control plane into ``target``, verified.

        Raises:
            AdapterFetchError: no fetcher, the control plane failed, or a hash mismatch.
        """
        if self.fetcher is None:
            raise AdapterFetchError(
                f"adapter {adapter_id}: worker {self.worker_id} has no bytes for it and no "
                "control plane to fetch them from"
            )
        try:
            n = fetch_to_file(self.fetcher, adapter_id, sha256, target)
        except AdapterFetchError:
            with self._lock:
                self.counters.fetch_failures += 1
            raise
        with self._lock:
            self.counters.fetches += 1
            self.counters.fetch_bytes += n
        log.info("adapter_fetched", adapter_id=adapter_id, sha256=sha256, bytes=n)

    def check_servable(self, adapter_set: AdapterSet) -> None:
        """Re-check a resolved set just before its request is submitted: every adapter still
        known and not draining (an unload may have started while it loaded), and the entry the
        request resolved is the host tier's (re-added if it went).

        Raises:
            AdapterNotFoundError: an adapter is being unloaded (or was).
        """
        with self._lock:
            for aid, a, _ in adapter_set.entries:
                if aid in self._draining or aid not in self._known:
                    raise AdapterNotFoundError(f"adapter {aid} is being unloaded from worker {self.worker_id}")
                if self._by_id.get(aid) is not a:
                    self._registry.add(aid, a)
                    self._touch(aid)

    def prefetch(self, adapter_set: AdapterSet) -> dict[str, Mapping[str, LoraPair]]:
        """Read ahead (caller's thread) the pooled tensors of the set's adapters that are not
        resident in a slot now (``LoraPool.stage``), so that admission on the decode loop only
        copies them into slots.

        Returns:
            sha256 → pooled pairs with data (what ``LoraPool.acquire`` takes as ``staged``).

        Raises:
            AdapterFetchError: an adapter's file cannot be re-read (it changed or vanished);
                its ``adapter_id`` names it (`discard_bad_copy`, then try again).
        """
        resident = self._pool.resident_shas()
        staged = {}
        for aid, a, _ in adapter_set.entries:
            if a.sha256 in resident or a.source is None:
                continue
            try:
                staged[a.sha256] = LoraPool.stage(a)
            except AdapterError as exc:
                raise AdapterFetchError(f"adapter {aid}: {exc}", adapter_id=aid) from exc
        return staged

    # --- unloading ------------------------------------------------------------------------
    def start_drain(self, adapter_id: int) -> None:
        """Refuse new requests for ``adapter_id`` from now on (``get``, ``check_servable``).

        Raises:
            AdapterNotFoundError: the id is not known.
        """
        with self._lock:
            if adapter_id not in self._known:
                raise AdapterNotFoundError(
                    f"adapter {adapter_id} is not loaded on worker {self.worker_id} (loaded: {sorted(self._known)})"
                )
            self._draining.add(adapter_id)

    def forget(self, adapter_id: int) -> None:
        """Free a drained adapter: its host entry, its slot and pin (when no other id has the
        same content), and its copy in the cache directory. Call it on the pool's owner thread,
        once no request holds the id and no context's active set uses it.

        Raises:
            worker.lora.registry.AdapterInUseError: a context's active set still uses it.
        """
        with self._lock:
            known = self._known.pop(adapter_id, None)
            last = known is not None and not any(k.sha256 == known.sha256 for k in self._known.values())
            if adapter_id in self._by_id:
                self._registry.free(adapter_id)
            elif known is not None and last:
                self._pool.evict(known.sha256)
            if known is not None and last:
                self._pool.set_pinned(known.sha256, False)
                (self.cache_dir / f"{known.sha256}.gguf").unlink(missing_ok=True)
            self._lru.pop(adapter_id, None)
            self._draining.discard(adapter_id)


__all__ = ["Fetcher", "HostCache", "HostCounters", "KnownAdapter", "fetch_to_file"]
