"""The worker engine: one base model, its adapters, one context and the scheduler.

Plain Python, no gRPC: ``worker.rpc.servicer`` converts protos to calls on this class and
exceptions to status codes. Adapter loads go through ``worker.lora.adapter.load_lora_adapter``
(validated, tensors on the device of the weight they patch). Unloading drains first: new
requests naming the adapter are refused, running ones finish, then the context detaches it
and the model frees it — a context never points at freed weights.

Three tiers (issue 12): the worker *knows* an adapter id (its sha256, name, pin flag) from a
``LoadAdapter`` call — with bytes, a server path, or ``fetch_on_demand`` (header only); it is
in the *host* tier once validated (``ModelAdapters.by_id``, at most ``--max-cpu-loras``, least
recently used evicted first, never one that a request holds, that is resident in a slot or
pinned) — file-backed: the tensor index in memory, the bytes in a local file the pool re-reads
at page-in (``worker.lora.adapter.open_lora_adapter``); the slot pool (``worker.lora.pool``)
holds what ubatches use. A request's adapters are brought to host at submit, on the caller's
thread (off the decode loop): from a local file, or fetched from the control plane by sha256
(``fetcher``) the first time, once per content however many requests ask at once; the
tensors of those not resident are read ahead then (``_stage``), so admission only copies.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from worker.config import WorkerConfig
from worker.errors import (
    AdapterConflictError,
    AdapterFetchError,
    AdapterNotFoundError,
    DrainTimeoutError,
    InvalidRequestError,
    WorkerError,
)
from worker.lora.adapter import AdapterError, LoraAdapter, open_lora_adapter
from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.lora.pool import LoraPool
from worker.runtime.context import Model
from worker.runtime.model import BaseModel, load_model
from worker.runtime.sampling import SamplingParams
from worker.serving.heap import release_free_heap
from worker.serving.metrics import WorkerMetrics
from worker.serving.request import Event, GenRequest
from worker.serving.scheduler import Scheduler, SchedulerStats

log = structlog.get_logger("loraplane.worker")


@dataclass
class KnownAdapter:
    """An adapter id this worker may serve: content hash, name, pin, and where its bytes are
    (``path`` empty: fetch from the control plane by sha256)."""

    sha256: str
    name: str
    path: str = ""
    pinned: bool = False


Fetcher = Callable[[str], "Iterator[bytes]"]
"""sha256 → the adapter's bytes in chunks (``worker.rpc.fetch.ControlPlaneFetcher``)."""


class FetchError(Exception):
    """The control plane could not give an adapter's bytes (the fetcher raises it)."""

    def __init__(self, message: str, *, not_found: bool = False):
        super().__init__(message)
        self.not_found = not_found


@dataclass
class PagingCounters:
    fetches: int = 0
    fetch_bytes: int = 0
    fetch_failures: int = 0
    host_loads: int = 0
    host_evictions: int = 0


@dataclass(frozen=True)
class WorkerStatsRecord:
    """Everything ``Stats`` reports: the scheduler's counters plus the fields below (proto
    ``WorkerStats`` = the union, field for field; ``worker.rpc.servicer.stats_to_proto``)."""

    scheduler: SchedulerStats
    worker_id: str
    batching: str
    prefix_cache: str
    model: str
    device: str
    dtype: str
    adapter_ids: list[int]
    node_budget: int
    adapter_bytes: int
    # adapter paging (issue 12): pool and host cache sizes, counts, counters
    max_loras: int = 0
    max_cpu_loras: int = 0
    resident_adapters: int = 0
    host_adapters: int = 0
    known_adapters: int = 0
    page_ins: int = 0
    evictions: int = 0
    page_in_bytes: int = 0
    host_evictions: int = 0
    fetches: int = 0
    fetch_bytes: int = 0
    fetch_failures: int = 0
    pool_bytes: int = 0
    resident_adapter_ids: list[int] = field(default_factory=list)
    host_adapter_ids: list[int] = field(default_factory=list)


def max_piece_bytes(tokenizer) -> int:
    """The most input bytes one token can stand for: the longest vocab piece in UTF-8 bytes.

    A piece's text is never shorter than the input it covers (spaces are escaped to the
    3-byte ``▁``, byte-fallback pieces ``<0xNN>`` cover one byte, ``<unk>`` one character).
    Gemma 3's vocab: 48 bytes.
    """
    return max(
        1, max(len(tokenizer.token_to_piece(i).encode("utf-8", "surrogatepass")) for i in range(tokenizer.n_vocab))
    )


def prompt_byte_limit(n_ctx_slot: int, piece_bytes: int) -> int:
    """Largest text prompt, in UTF-8 bytes, that could still fit a slot: a longer one needs at
    least ``n_ctx_slot`` tokens, which ``Scheduler.submit`` refuses anyway, so refusing it
    before tokenizing changes no answer, only the cost (Gemma 3, n_ctx 4096: 196 560 bytes)."""
    return (n_ctx_slot - 1) * piece_bytes


def fetch_to_file(fetcher: Fetcher, adapter_id: int, sha256: str, target: Path) -> int:
    """Stream ``fetcher(sha256)`` into ``target`` through a temporary file, keeping it only if
    the bytes hash to ``sha256``; returns the byte count.

    Raises:
        AdapterFetchError: the fetcher failed (``not_found`` kept), or a hash mismatch; no
            file is left behind either way.
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
    except FetchError as exc:
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


class WorkerEngine:
    """Holds the model, context, scheduler and adapter table of one worker process."""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.worker_id = config.worker_id or f"worker-{uuid.uuid4().hex[:8]}"
        base = load_model(config.model_path, dtype=config.dtype, device=config.device, weights=config.weight_form)
        self.model = Model(base, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank)
        self.ctx = self.model.new_context(n_ctx_seq=config.n_ctx_slot, n_seq=config.n_slots)
        self.scheduler = Scheduler(self.ctx, config, self.worker_id)
        self.metrics = WorkerMetrics(self.stats, adapter_label_cap=config.metrics_max_adapters)
        self.scheduler.observer = self.metrics
        self._lock = threading.Lock()
        self._draining: set[int] = set()
        self._known: dict[int, KnownAdapter] = {}
        self._host_lru: dict[int, None] = {}  # host tier order, least recently used first
        self._submitting: dict[int, int] = {}  # adapter id -> requests resolving it now (kept on host)
        self._inflight_loads: dict[str, concurrent.futures.Future[LoraAdapter]] = {}
        self.counters = PagingCounters()
        self.fetcher: Fetcher | None = None
        # The pid in the name tells operators (and tests) whose directory it is.
        self._cache_dir = Path(tempfile.mkdtemp(prefix=f"loraplane-worker-adapters-{os.getpid()}-"))
        self.max_piece_bytes = max_piece_bytes(base.tokenizer)
        self.max_prompt_bytes = prompt_byte_limit(config.n_ctx_slot, self.max_piece_bytes)
        self._tokenize_lock = threading.Lock()
        self.scheduler.start()

    @property
    def base(self) -> BaseModel:
        return self.model.base

    def close(self) -> None:
        """Stop the scheduler, free the context, and remove the adapter temp dir (uploaded
        adapter files are copies: the control plane keeps the originals)."""
        self.scheduler.stop()
        self.ctx.close()
        shutil.rmtree(self._cache_dir, ignore_errors=True)

    # --- adapters -------------------------------------------------------------------------
    def load_adapter(
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

        With ``data`` or ``path`` it is validated into the host tier now (its rank
        checked against ``--max-lora-rank``). With ``fetch_on_demand`` only the id → sha256
        mapping is recorded; the bytes are fetched from the control plane when a request first
        needs them. ``pinned`` (None: unchanged) sets the pin flag either way.

        Raises:
            InvalidRequestError: bad file, rank above ``--max-lora-rank``, hash mismatch, no
                source given.
            AdapterConflictError: the id is held by different content.
            AdapterNotFoundError: no file at the path.
        """
        if fetch_on_demand and not data and not path:
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
                    self._set_pinned(adapter_id, known, pinned)
            return known
        if data:
            digest = hashlib.sha256(data).hexdigest()
            if sha256 and digest != sha256:
                raise InvalidRequestError(f"adapter {adapter_id}: sha256 mismatch (expected {sha256}, got {digest})")
            target = self._cache_dir / f"{digest}.gguf"
            target.write_bytes(data)
            path = str(target)
        elif not path:
            raise InvalidRequestError(f"adapter {adapter_id}: neither server_path nor data given")
        elif not os.path.isfile(path):
            raise AdapterNotFoundError(f"adapter {adapter_id}: no file at '{path}' on worker {self.worker_id}")
        with self._lock:
            held = self.model.adapters.by_id.get(adapter_id)
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
            self._put_host(adapter_id, adapter)
            self._draining.discard(adapter_id)
            if pinned is not None:
                self._set_pinned(adapter_id, known, pinned)
        log.info("adapter loaded", adapter_id=adapter_id, name=adapter.name, pairs=len(adapter.pairs))
        return adapter

    def _read(self, adapter_id: int, path: str) -> LoraAdapter:
        """Validate ``path`` into the host tier, file-backed (``open_lora_adapter``: the pool
        re-reads the tensors at page-in), its rank checked against the pool.

        Raises:
            InvalidRequestError: the file fails validation or a rank exceeds --max-lora-rank.
        """
        try:
            adapter = open_lora_adapter(
                path, base_arch=self.base.arch, base_tensors=self.base.tensor_ne, device_for=self.base.device_of
            )
        except AdapterError as exc:
            raise InvalidRequestError(str(exc)) from exc
        too_big = max(adapter.ranks, default=0)
        if too_big > self.config.max_lora_rank:
            raise InvalidRequestError(
                f"adapter {adapter_id} ('{adapter.name}') has rank {too_big}, above this worker's "
                f"--max-lora-rank {self.config.max_lora_rank}"
            )
        self.counters.host_loads += 1
        self.metrics.on_adapter_loaded()  # every load into host memory: eager, local file or fetched
        return adapter

    def _set_pinned(self, adapter_id: int, known: KnownAdapter, pinned: bool) -> None:
        """Record the pin flag (caller holds the lock); the pool applies it on the loop thread."""
        known.pinned = pinned
        sha = known.sha256
        self.scheduler.run_soon(lambda: self.ctx.pool.set_pinned(sha, pinned))

    def _put_host(self, adapter_id: int, adapter: LoraAdapter) -> None:
        """Insert into the host tier (caller holds the lock) and evict beyond --max-cpu-loras."""
        self.model.adapters.add(adapter_id, adapter)
        self._host_lru.pop(adapter_id, None)
        self._host_lru[adapter_id] = None
        self._evict_host()

    def _evict_host(self) -> None:
        """Drop least recently used host entries beyond ``max_cpu_loras`` that no request holds,
        that are not resident in a slot and not pinned (caller holds the lock). A dropped
        adapter's copy in the worker's cache directory (fetched or pushed bytes) is deleted
        too when a control plane can give the bytes again, so local disk holds at most the
        host tier, not every adapter ever served; files under ``--adapter-dir`` are never
        touched."""
        cap = max(self.config.max_cpu_loras, self.config.max_loras)
        by_id = self.model.adapters.by_id
        over = len(by_id) - cap
        if over <= 0:
            return
        resident = self.ctx.pool.resident_shas()
        for aid in list(self._host_lru):
            if over <= 0:
                break
            a = by_id.get(aid)
            known = self._known.get(aid)
            if a is None:
                self._host_lru.pop(aid, None)
                continue
            if (
                a.sha256 in resident
                or (known is not None and known.pinned)
                or self.scheduler.adapter_in_flight(aid)
                or self._submitting.get(aid, 0)
                or aid in self._draining
            ):
                continue
            del by_id[aid]
            self._host_lru.pop(aid, None)
            self.counters.host_evictions += 1
            over -= 1
            if self.fetcher is not None and not any(
                b.sha256 == a.sha256 for b in by_id.values()
            ):  # re-fetched by sha256 on next use
                (self._cache_dir / f"{a.sha256}.gguf").unlink(missing_ok=True)

    def _to_host(self, adapter_id: int, hold: list[int]) -> tuple[LoraAdapter, str]:
        """The adapter's host entry and where it came from ("host", "loaded", "fetched").

        Runs on the caller's thread. One load per content at a time: concurrent requests for
        the same adapter wait for the first one's load. The id is appended to ``hold`` and
        counted in ``_submitting`` (the host tier keeps it and its file) until the caller
        drops it with ``_unhold`` — after the scheduler counts the request in flight.

        Raises:
            AdapterNotFoundError: the id is unknown or being unloaded.
            AdapterFetchError: the control plane could not give the bytes, or they do not hash
                to the registered sha256.
            InvalidRequestError: the fetched file fails validation.
        """
        with self._lock:
            a = self.model.adapters.by_id.get(adapter_id)
            known = self._known.get(adapter_id)
            if a is not None:
                self._host_lru.pop(adapter_id, None)
                self._host_lru[adapter_id] = None
                self._hold(adapter_id, hold)
                return a, "host"
            if known is None or adapter_id in self._draining:
                raise AdapterNotFoundError(
                    f"adapter {adapter_id} is not loaded on worker {self.worker_id} "
                    f"(loaded: {sorted(i for i in self._known if i not in self._draining)})"
                )
            fut = self._inflight_loads.get(known.sha256)
            owner = fut is None
            if owner:
                fut = self._inflight_loads[known.sha256] = concurrent.futures.Future()
        assert fut is not None
        if not owner:
            fut.result()  # the first request's load (its error is ours too)
            return self._to_host(adapter_id, hold)  # a host hit now, or loaded again if dropped since
        try:
            source = "loaded"
            path = known.path
            if not path or not os.path.isfile(path):
                cached = self._cache_dir / f"{known.sha256}.gguf"
                if not cached.is_file():
                    self._fetch(adapter_id, known.sha256, cached)
                    source = "fetched"
                path = str(cached)
            adapter = self._read(adapter_id, path)
            if adapter.sha256 != known.sha256:
                raise AdapterFetchError(
                    f"adapter {adapter_id}: file '{path}' hashes to {adapter.sha256}, registered as {known.sha256}"
                )
            with self._lock:
                self._hold(adapter_id, hold)
                if adapter_id in self._known:
                    self._put_host(adapter_id, adapter)
            fut.set_result(adapter)
            return adapter, source
        except BaseException as exc:
            fut.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._inflight_loads.pop(known.sha256, None)

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
            self.counters.fetch_failures += 1
            raise
        self.counters.fetches += 1
        self.counters.fetch_bytes += n
        log.info("adapter fetched", adapter_id=adapter_id, sha256=sha256, bytes=n)

    def unload_adapter(self, adapter_id: int, timeout_s: float = 60.0) -> None:
        """Drain then free ``adapter_id`` (refuses new requests for it at once): its host
        tensors, its slot, its cached bytes.

        Raises:
            AdapterNotFoundError: not loaded.
            DrainTimeoutError: requests still running after ``timeout_s``.
        """
        with self._lock:
            if adapter_id not in self._known:
                raise AdapterNotFoundError(
                    f"adapter {adapter_id} is not loaded on worker {self.worker_id} (loaded: {sorted(self._known)})"
                )
            self._draining.add(adapter_id)
        done = self.scheduler.run_when_idle_of(adapter_id, lambda: self._detach_and_free(adapter_id))
        try:
            done.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError as exc:
            raise DrainTimeoutError(f"adapter {adapter_id} still used by running requests") from exc

    def _detach_and_free(self, adapter_id: int) -> None:
        """Runs on the scheduler thread between steps: detach from the context, then free."""
        if any(adapter_id in s.ids for s in self.ctx.active_sets):
            self.ctx.set_adapters(EMPTY_SET)
        with self._lock:
            known = self._known.pop(adapter_id, None)
            if adapter_id in self.model.adapters.by_id:
                self.model.adapters.free(adapter_id)
            elif known is not None and not any(k.sha256 == known.sha256 for k in self._known.values()):
                self.ctx.pool.evict(known.sha256)
            if known is not None and not any(k.sha256 == known.sha256 for k in self._known.values()):
                self.ctx.pool.set_pinned(known.sha256, False)
                (self._cache_dir / f"{known.sha256}.gguf").unlink(missing_ok=True)
            self._host_lru.pop(adapter_id, None)
            self._draining.discard(adapter_id)
        self.metrics.on_adapter_freed()
        log.info("adapter freed", adapter_id=adapter_id)

    def draining_ids(self) -> set[int]:
        """Adapters being unloaded: refused for new requests, freed once idle."""
        with self._lock:
            return set(self._draining)

    def adapters(self) -> dict[int, LoraAdapter]:
        """Adapters with host tensors now."""
        with self._lock:
            return dict(self.model.adapters.by_id)

    def known(self) -> dict[int, KnownAdapter]:
        """Every adapter id this worker may serve."""
        with self._lock:
            return dict(self._known)

    # --- requests -------------------------------------------------------------------------
    def resolve_set(
        self, entries: list[tuple[int, float]], hold: list[int]
    ) -> tuple[AdapterSet, dict[int, tuple[str, float]]]:
        """Turn a resolved adapter vector into an ``AdapterSet`` (zero scales dropped), bringing
        each adapter's tensors to host memory (load or fetch) on the caller's thread.

        Returns:
            The set, and per adapter id (source, ms spent getting it to host).

        Raises:
            AdapterNotFoundError: adapter not known or being unloaded.
            AdapterFetchError: its bytes could not be fetched (missing, hash mismatch).
            InvalidRequestError: non-finite scale, duplicate id, a file failing validation.
        """
        wanted: dict[int, float] = {}
        for aid, scale in entries:
            if not math.isfinite(scale):
                raise InvalidRequestError(f"adapter {aid}: scale {scale} is not finite")
            if aid in wanted:
                raise InvalidRequestError(f"adapter {aid} appears twice in the adapter vector")
            wanted[aid] = scale
        seen: dict[int, tuple[LoraAdapter, float]] = {}
        sources: dict[int, tuple[str, float]] = {}
        for aid, scale in wanted.items():
            if scale == 0.0:
                continue
            t0 = time.monotonic()
            adapter, source = self._to_host(aid, hold)
            seen[aid] = (adapter, scale)
            sources[aid] = (source, (time.monotonic() - t0) * 1000)
        return AdapterSet.of(seen), sources

    def submit(
        self,
        *,
        request_id: str,
        prompt_tokens: list[int] | None,
        prompt_text: str | None,
        params: SamplingParams,
        entries: list[tuple[int, float]],
        emit: Callable[[Event], None],
    ) -> GenRequest:
        """Tokenize (text prompts: BOS per the model, special tokens parsed), resolve the
        adapter set (fetching what this worker lacks) and admit the request.

        Raises:
            WorkerError: a subclass naming the outcome (``worker.errors``).
        """
        try:
            if prompt_tokens is None:
                prompt_tokens = self.tokenize(prompt_text or "")
            return self._admit(request_id, prompt_tokens, params, entries, emit)
        except WorkerError:
            self.metrics.on_rejected(tuple(sorted(i for i, s in entries if s != 0.0)))
            raise

    def _admit(
        self,
        request_id: str,
        prompt_tokens: list[int],
        params: SamplingParams,
        entries: list[tuple[int, float]],
        emit: Callable[[Event], None],
    ) -> GenRequest:
        hold: list[int] = []  # the host tier keeps these (and their files) until submitted
        loads = self.counters.host_loads
        try:
            return self._resolve_and_submit(request_id, prompt_tokens, params, entries, emit, hold)
        finally:
            with self._lock:
                self._unhold(hold)
            if self.counters.host_loads != loads:
                release_free_heap()  # validation buffers freed on this thread (worker.serving.heap)

    def _hold(self, adapter_id: int, hold: list[int]) -> None:
        """Keep ``adapter_id`` in the host tier for a request being submitted (lock held)."""
        self._submitting[adapter_id] = self._submitting.get(adapter_id, 0) + 1
        hold.append(adapter_id)

    def _unhold(self, hold: list[int]) -> None:
        for aid in hold:
            n = self._submitting.get(aid, 0) - 1
            if n > 0:
                self._submitting[aid] = n
            else:
                self._submitting.pop(aid, None)
        hold.clear()
        self._evict_host()

    def _resolve_and_submit(
        self,
        request_id: str,
        prompt_tokens: list[int],
        params: SamplingParams,
        entries: list[tuple[int, float]],
        emit: Callable[[Event], None],
        hold: list[int],
    ) -> GenRequest:
        adapter_set, sources = self.resolve_set(entries, hold)
        staged = self._stage(adapter_set)
        with self._lock:
            # Re-check under the lock: an unload may have started, or the host tier may have
            # dropped an entry, while we loaded; the scheduler counts the request in flight
            # before the lock is released, so the host tier cannot drop it afterwards.
            for aid, a, _ in adapter_set.entries:
                if aid in self._draining or aid not in self._known:
                    raise AdapterNotFoundError(f"adapter {aid} is being unloaded from worker {self.worker_id}")
                if self.model.adapters.by_id.get(aid) is not a:
                    self.model.adapters.add(aid, a)
                    self._host_lru[aid] = None
            req = self.scheduler.submit(
                request_id=request_id,
                prompt=prompt_tokens,
                params=params,
                adapter_set=adapter_set,
                emit=emit,
                host_sources=sources,
                staged=staged,
            )
            self._evict_host()
        return req

    def _stage(self, adapter_set: AdapterSet) -> dict:
        """Read ahead (caller's thread) the pooled tensors of the set's adapters that are not
        resident now, so that admission on the decode loop only copies them into slots.

        Raises:
            AdapterFetchError: an adapter's file cannot be re-read (it changed or vanished).
        """
        resident = self.ctx.pool.resident_shas()
        staged = {}
        for aid, a, _ in adapter_set.entries:
            if a.sha256 in resident or a.source is None:
                continue
            try:
                staged[a.sha256] = LoraPool.stage(a)
            except AdapterError as exc:
                raise AdapterFetchError(f"adapter {aid}: {exc}") from exc
        return staged

    def tokenize(self, text: str) -> list[int]:
        """Tokenize a text prompt, size first.

        A text over ``max_prompt_bytes`` (`prompt_byte_limit`) is refused before any
        tokenization, since it cannot fit the slot context. Tokenizations run one at a time
        (``_tokenize_lock``): the decode loop then shares the interpreter with at most one
        tokenizing thread, for at most ~0.6 s (the limit's worth of text on this CPU).

        Raises:
            InvalidRequestError: the text is longer than ``max_prompt_bytes`` UTF-8 bytes.
        """
        n_bytes = len(text) if len(text) > self.max_prompt_bytes else len(text.encode("utf-8", "surrogatepass"))
        if n_bytes > self.max_prompt_bytes:
            raise InvalidRequestError(
                f"prompt text has {n_bytes} bytes (or more); a slot holds n_ctx={self.config.n_ctx_slot} tokens "
                f"and one token covers at most {self.max_piece_bytes} bytes, so at most "
                f"{self.max_prompt_bytes} bytes can fit (refused before tokenizing)"
            )
        with self._tokenize_lock:
            return self.base.tokenizer.encode(text, add_special=True, parse_special=True)

    def stats(self) -> WorkerStatsRecord:
        """Scheduler counters plus the worker's identity, model, adapter footprint and paging."""
        ads = self.adapters()
        adapter_bytes = sum(
            p.lora_a.numel() * p.lora_a.element_size() + p.lora_b.numel() * p.lora_b.element_size()
            for a in ads.values()
            for p in a.pairs.values()
        )
        pool = self.ctx.pool
        known = self.known()
        resident_sha = pool.resident_shas()
        return WorkerStatsRecord(
            worker_id=self.worker_id,
            batching=self.config.batching.value,
            prefix_cache=self.config.prefix_cache.value,
            model=str(self.base.path),
            device=str(self.base.device),
            dtype=self.config.dtype,
            adapter_ids=sorted(known),
            node_budget=self.ctx.node_budget,
            adapter_bytes=adapter_bytes,
            max_loras=pool.max_loras,
            max_cpu_loras=self.config.max_cpu_loras,
            resident_adapters=len(resident_sha),
            host_adapters=len(ads),
            known_adapters=len(known),
            page_ins=pool.stats.page_ins,
            evictions=pool.stats.evictions,
            page_in_bytes=pool.stats.page_in_bytes,
            host_evictions=self.counters.host_evictions,
            fetches=self.counters.fetches,
            fetch_bytes=self.counters.fetch_bytes,
            fetch_failures=self.counters.fetch_failures,
            pool_bytes=pool.buffer_bytes(),
            resident_adapter_ids=sorted(i for i, k in known.items() if k.sha256 in resident_sha),
            host_adapter_ids=sorted(ads),
            scheduler=self.scheduler.stats(),
        )

    def residency(self) -> tuple[list[int], list[int]]:
        """(ids resident in slots, ids with host tensors) — what heartbeats report."""
        known = self.known()
        resident_sha = self.ctx.pool.resident_shas()
        return (sorted(i for i, k in known.items() if k.sha256 in resident_sha), sorted(self.adapters()))


__all__ = ["FetchError", "Fetcher", "fetch_to_file", "KnownAdapter", "WorkerEngine", "WorkerStatsRecord"]
