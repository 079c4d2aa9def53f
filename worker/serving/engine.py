"""The worker engine: one base model, its adapters, one context and the scheduler.

Plain Python, no gRPC: ``worker.rpc.servicer`` converts protos to calls on this class and
exceptions to status codes. ``WorkerEngine`` owns and wires the pieces: the model and its slot
pool (``worker.runtime.context.Model``), the context, the scheduler (``worker.serving.scheduler``)
and the host tier of adapters (``worker.lora.host_cache.HostCache``: known adapters, the
validated file-backed entries, fetching from the control plane, draining).

A request's adapters are brought to host at submit, on the caller's thread (off the decode
loop): the request holds them in the scheduler first (``Scheduler.holding``), so the host tier
keeps them (and their fetched files) from the moment they are found or loaded until the
request ends — ``Scheduler.submit`` takes the request's own holds before the submit-time ones
are dropped, leaving no gap in which the host tier could drop an adapter a request is about
to use. The tensors of those not resident in a slot are read ahead then
(``HostCache.prefetch``), so admission on the loop only copies. Unloading drains: new requests
naming the adapter are refused at once, running ones finish, then the context detaches it and
the host tier frees it — a context never points at freed weights.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from loraplane.adapter_scales import AdapterScales
from worker.config import WorkerConfig
from worker.errors import (
    AdapterFetchError,
    DrainTimeoutError,
    InvalidRequestError,
    WorkerDrainingError,
    WorkerError,
)
from worker.lora.adapter import LoraAdapter, open_lora_adapter
from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.lora.host_cache import Fetcher, HostCache, KnownAdapter
from worker.runtime.context import Model
from worker.runtime.grammar import start_grammar_warmup
from worker.runtime.model import LoadedModel, load_model
from worker.runtime.sampling import SamplingParams
from worker.serving.heap import release_free_heap
from worker.serving.metrics import WorkerMetrics
from worker.serving.request import Event, GenRequest, RequestTenant
from worker.serving.scheduler import Scheduler
from worker.serving.stats import SchedulerStats

log = structlog.get_logger("loraplane.worker.serving.engine")


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
    # adapter paging: pool and host tier sizes, counts, counters
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
    pinned_adapter_ids: list[int] = field(default_factory=list)  # resident and pinned in their slot


def max_piece_bytes(tokenizer) -> int:
    """The most input bytes one token can stand for: the longest vocab piece in UTF-8 bytes.

    A piece's text is never shorter than the input it covers (spaces are escaped to the
    3-byte ``▁``, byte-fallback pieces ``<0xNN>`` cover one byte, ``<unk>`` one character).
    Gemma 3's vocab: 48 bytes.
    """
    return max(
        1, max(len(tokenizer.token_to_piece(i).encode("utf-8", "surrogatepass")) for i in range(tokenizer.n_vocab))
    )


def prompt_byte_limit(n_ctx_seq: int, piece_bytes: int) -> int:
    """Largest text prompt, in UTF-8 bytes, that could still fit a sequence: a longer one needs at
    least ``n_ctx_seq`` tokens, which ``Scheduler.submit`` refuses anyway, so refusing it
    before tokenizing changes no answer, only the cost (Gemma 3, n_ctx 4096: 196 560 bytes)."""
    return (n_ctx_seq - 1) * piece_bytes


class WorkerEngine:
    """Holds the model, context, scheduler and host tier of one worker process.

    Args:
        config: the worker's start-up options; the model is loaded and the scheduler's loop
            thread started here.
    """

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.worker_id = config.worker_id or f"worker-{uuid.uuid4().hex[:8]}"
        base = load_model(config.model_path, dtype=config.dtype, device=config.device, weights=config.weight_form)
        self.grammar_warmup: threading.Thread | None = None
        """Builds the grammar engine's vocabulary view beside the rest of start-up
        (``--no-grammar-warmup``: None); `worker.rpc.server` joins it before registering."""
        if config.grammar_warmup:
            self.grammar_warmup = start_grammar_warmup(base.tokenizer, base.n_vocab)
        self.model = Model(base, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank)
        self.ctx = self.model.new_context(
            n_ctx_seq=config.n_ctx_seq, n_seq=config.n_seqs, kv_dtype=config.kv_cache_dtype
        )
        self.scheduler = Scheduler(self.ctx, config, self.worker_id)
        self._paging_lock = threading.Lock()
        self._paging_seen: dict[int, tuple[int, int]] = {}  # adapter_paging's last counts
        self.metrics = WorkerMetrics(
            self.stats, adapter_label_cap=config.metrics_max_adapters, adapter_paging=self.adapter_paging
        )
        self.scheduler.observer = self.metrics
        self.host = HostCache(
            self.model.adapters,
            open_adapter=functools.partial(
                open_lora_adapter, base_arch=base.arch, base_tensors=base.tensor_ne, device_for=base.device_of
            ),
            capacity=max(config.max_cpu_loras, config.max_loras),
            max_lora_rank=config.max_lora_rank,
            in_use=self.scheduler.holds.is_held,
            set_pinned=self._set_pinned,
            worker_id=self.worker_id,
            on_loaded=self.metrics.on_adapter_loaded,
        )
        self.max_piece_bytes = max_piece_bytes(base.tokenizer)
        self.max_prompt_bytes = prompt_byte_limit(config.n_ctx_seq, self.max_piece_bytes)
        self._tokenize_lock = threading.Lock()
        self.draining = threading.Event()
        """Set on SIGTERM (``worker.rpc.server``): ``submit`` refuses everything from then on."""
        self.scheduler.start()

    @property
    def base(self) -> LoadedModel:
        """The loaded base model (weights, tokenizer, hparams)."""
        return self.model.base

    @property
    def fetcher(self) -> Fetcher | None:
        """Where the host tier fetches adapter bytes by sha256 (None: nowhere)."""
        return self.host.fetcher

    @fetcher.setter
    def fetcher(self, fetcher: Fetcher | None) -> None:
        """Set by the process once it knows its control plane (``worker.rpc.fetch``)."""
        self.host.fetcher = fetcher

    def close(self) -> None:
        """Stop the scheduler, free the context, and remove the adapter cache directory."""
        self.scheduler.stop()
        self.ctx.close()
        self.host.close()

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
        """Register an adapter under the id the control plane assigned (``HostCache.register``:
        validated now from ``data`` or ``path``, or only its sha256 recorded with
        ``fetch_on_demand``; ``pinned`` None leaves the pin flag as it is).

        Raises:
            InvalidRequestError: bad file, rank above ``--max-lora-rank``, hash mismatch, no
                source given.
            AdapterConflictError: the id is held by different content.
            AdapterNotFoundError: no file at the path.
        """
        return self.host.register(
            adapter_id,
            sha256=sha256,
            path=path,
            data=data,
            name=name,
            fetch_on_demand=fetch_on_demand,
            pinned=pinned,
        )

    def _set_pinned(self, sha256: str, pinned: bool) -> None:
        """Apply a pin flag in the pool on the loop thread (the pool's owner)."""
        self.scheduler.run_soon(lambda: self.ctx.pool.set_pinned(sha256, pinned))

    def unload_adapter(self, adapter_id: int, timeout_s: float = 60.0) -> None:
        """Drain then free ``adapter_id`` (refuses new requests for it at once): its host
        entry, its slot, its cached bytes.

        Raises:
            AdapterNotFoundError: not loaded.
            DrainTimeoutError: requests still hold it after ``timeout_s`` (it stays draining
                and is freed once idle).
        """
        self.host.start_drain(adapter_id)
        done = self.scheduler.run_when_idle_of(adapter_id, lambda: self._detach_and_free(adapter_id))
        try:
            done.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError as exc:
            raise DrainTimeoutError(f"adapter {adapter_id} still used by running requests") from exc

    def _detach_and_free(self, adapter_id: int) -> None:
        """Runs on the scheduler thread between steps: detach from the context, then free."""
        if any(adapter_id in s.ids for s in self.ctx.active_sets):
            self.ctx.set_adapters(EMPTY_SET)
        self.host.forget(adapter_id)
        self.metrics.on_adapter_freed()
        log.info("adapter_freed", adapter_id=adapter_id)

    def draining_ids(self) -> set[int]:
        """Adapters being unloaded: refused for new requests, freed once idle."""
        return self.host.draining_ids()

    def adapters(self) -> dict[int, LoraAdapter]:
        """The host tier: adapters validated now."""
        return self.host.host()

    def known(self) -> dict[int, KnownAdapter]:
        """Every adapter id this worker may serve."""
        return self.host.known()

    # --- requests -------------------------------------------------------------------------
    def submit(
        self,
        *,
        request_id: str,
        prompt_tokens: list[int] | None,
        prompt_text: str | None,
        params: SamplingParams,
        adapters: AdapterScales,
        emit: Callable[[Event], None],
        tenant: RequestTenant | None = None,
    ) -> GenRequest:
        """Tokenize (text prompts: BOS per the model, special tokens parsed), build the
        ``AdapterSet`` of ``adapters`` (fetching what this worker lacks) and admit the request.
        ``tenant``: who it is accounted to (fair admission; None: "anonymous").

        Raises:
            WorkerDrainingError: the worker is shutting down (``draining`` is set).
            WorkerError: a subclass naming the outcome (``worker.errors``); the request is
                counted as rejected in the metrics.
        """
        try:
            if self.draining.is_set():
                raise WorkerDrainingError(
                    f"worker {self.worker_id} is draining (shutting down) and admits no new request "
                    f"{request_id}; retry on another worker"
                )
            if prompt_tokens is None:
                prompt_tokens = self.tokenize(prompt_text or "")
            return self._admit(request_id, prompt_tokens, params, adapters, emit, tenant)
        except WorkerError:
            self.metrics.on_rejected(adapters.ids)
            raise

    def _admit(
        self,
        request_id: str,
        prompt_tokens: list[int],
        params: SamplingParams,
        adapters: AdapterScales,
        emit: Callable[[Event], None],
        tenant: RequestTenant | None = None,
    ) -> GenRequest:
        """Hold the request's adapters, bring them to host, read ahead what is not resident,
        re-check that none is being unloaded, and submit (module docstring: no gap between
        the submit-time holds and the request's own).

        Raises:
            WorkerError: from ``HostCache.get``, ``HostCache.prefetch``,
                ``HostCache.check_servable`` or ``Scheduler.submit``.
        """
        loads = self.host.counters.host_loads
        try:
            with self.scheduler.holds.holding(adapters.ids):
                adapter_set, sources = self._to_host(adapters)
                try:
                    staged = self.host.prefetch(adapter_set)
                except AdapterFetchError as exc:
                    # a local copy deleted or changed on disk: fetch it again once, then fail
                    if exc.adapter_id is None or not self.host.discard_bad_copy(exc.adapter_id):
                        raise
                    adapter_set, sources = self._to_host(adapters)
                    staged = self.host.prefetch(adapter_set)
                self.host.check_servable(adapter_set)
                return self.scheduler.submit(
                    request_id=request_id,
                    prompt=prompt_tokens,
                    params=params,
                    adapter_set=adapter_set,
                    emit=emit,
                    host_sources=sources,
                    staged=staged,
                    tenant=tenant,
                )
        finally:
            self.host.trim()  # entries kept only by this request's submit-time holds may go now
            if self.host.counters.host_loads != loads:
                release_free_heap()  # validation buffers freed on this thread (worker.serving.heap)

    def _to_host(self, adapters: AdapterScales) -> tuple[AdapterSet, dict[int, tuple[str, float]]]:
        """Bring each adapter of ``adapters`` to the host tier.

        Returns:
            The ``AdapterSet`` (`AdapterSet.of_scales`), and per adapter id (source, ms spent
            getting it to host).

        Raises:
            AdapterNotFoundError, AdapterFetchError, InvalidRequestError: ``HostCache.get``.
        """
        loaded: dict[int, LoraAdapter] = {}
        sources: dict[int, tuple[str, float]] = {}
        for aid in adapters.ids:
            t0 = time.monotonic()
            loaded[aid], source = self.host.get(aid)
            sources[aid] = (source, (time.monotonic() - t0) * 1000)
        return AdapterSet.of_scales(adapters, loaded), sources

    def tokenize(self, text: str) -> list[int]:
        """Tokenize a text prompt, size first.

        A text over ``max_prompt_bytes`` (`prompt_byte_limit`) is refused before any
        tokenization, since it cannot fit the sequence's context. Tokenizations run one at a time
        (``_tokenize_lock``): the decode loop then shares the interpreter with at most one
        tokenizing thread, for at most ~0.6 s (the limit's worth of text on this CPU).

        Raises:
            InvalidRequestError: the text is longer than ``max_prompt_bytes`` UTF-8 bytes.
        """
        n_bytes = len(text) if len(text) > self.max_prompt_bytes else len(text.encode("utf-8", "surrogatepass"))
        if n_bytes > self.max_prompt_bytes:
            raise InvalidRequestError(
                f"prompt text has {n_bytes} bytes (or more); a sequence holds n_ctx={self.config.n_ctx_seq} tokens "
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
        pinned_sha = pool.pinned_shas()
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
            host_evictions=self.host.counters.host_evictions,
            fetches=self.host.counters.fetches,
            fetch_bytes=self.host.counters.fetch_bytes,
            fetch_failures=self.host.counters.fetch_failures,
            pool_bytes=pool.buffer_bytes(),
            resident_adapter_ids=sorted(i for i, k in known.items() if k.sha256 in resident_sha),
            host_adapter_ids=sorted(ads),
            pinned_adapter_ids=sorted(i for i, k in known.items() if k.sha256 in pinned_sha),
            scheduler=self.scheduler.stats(),
        )

    def adapter_paging(self) -> dict[int, tuple[int, int]]:
        """Adapter id → (page-ins into a device slot, LRU evictions out of one), cumulative for
        this process, for the adapters with a nonzero count (the pool counts by content; every
        known id with that content gets the count). An id no longer known keeps its last counts,
        so the counters never go back (any thread)."""
        st = self.ctx.pool.stats
        page_ins, evictions = dict(st.page_ins_by_sha), dict(st.evictions_by_sha)
        with self._paging_lock:
            for i, k in self.known().items():
                p, e = page_ins.get(k.sha256, 0), evictions.get(k.sha256, 0)
                if p or e:
                    self._paging_seen[i] = (p, e)
            return dict(self._paging_seen)

    def residency(self) -> tuple[list[int], list[int]]:
        """(ids resident in slots, ids with host tensors) — what heartbeats report."""
        known = self.known()
        resident_sha = self.ctx.pool.resident_shas()
        return (sorted(i for i, k in known.items() if k.sha256 in resident_sha), sorted(self.adapters()))


__all__ = ["WorkerEngine", "WorkerStatsRecord", "max_piece_bytes", "prompt_byte_limit"]
