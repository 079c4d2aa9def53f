"""The worker engine: one base model, its adapters, one context and the scheduler.

Plain Python, no gRPC: ``worker.rpc.servicer`` converts protos to calls on this class and
exceptions to status codes. Adapter loads go through ``worker.lora.adapter.load_lora_adapter``
(validated, tensors on the device of the weight they patch). Unloading drains first: new
requests naming the adapter are refused, running ones finish, then the context detaches it
and the model frees it — a context never points at freed weights.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import os
import shutil
import tempfile
import threading
import uuid
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from worker.lora.adapter import AdapterError, LoraAdapter, load_lora_adapter
from worker.config import WorkerConfig
from worker.runtime.context import Model
from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.runtime.model import BaseModel, load_model
from worker.runtime.sampling import SamplingParams
from worker.serving.scheduler import Scheduler, SchedulerStats
from worker.errors import (AdapterConflictError, AdapterNotFoundError, DrainTimeoutError,
                           InvalidRequestError, WorkerError)
from worker.serving.metrics import WorkerMetrics
from worker.serving.request import Event, GenRequest

log = structlog.get_logger("loraplane.worker")


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


def max_piece_bytes(tokenizer) -> int:
    """The most input bytes one token can stand for: the longest vocab piece in UTF-8 bytes.

    A piece's text is never shorter than the input it covers (spaces are escaped to the
    3-byte ``▁``, byte-fallback pieces ``<0xNN>`` cover one byte, ``<unk>`` one character).
    Gemma 3's vocab: 48 bytes.
    """
    return max(1, max(len(tokenizer.token_to_piece(i).encode("utf-8", "surrogatepass"))
                      for i in range(tokenizer.n_vocab)))


def prompt_byte_limit(n_ctx_slot: int, piece_bytes: int) -> int:
    """Largest text prompt, in UTF-8 bytes, that could still fit a slot: a longer one needs at
    least ``n_ctx_slot`` tokens, which ``Scheduler.submit`` refuses anyway, so refusing it
    before tokenizing changes no answer, only the cost (Gemma 3, n_ctx 4096: 196 560 bytes)."""
    return (n_ctx_slot - 1) * piece_bytes


class WorkerEngine:
    """Holds the model, context, scheduler and adapter table of one worker process."""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.worker_id = config.worker_id or f"worker-{uuid.uuid4().hex[:8]}"
        base = load_model(config.model_path, dtype=config.dtype, device=config.device, weights=config.weight_form)
        self.model = Model(base)
        self.ctx = self.model.new_context(n_ctx_seq=config.n_ctx_slot, n_seq=config.n_slots)
        self.scheduler = Scheduler(self.ctx, config, self.worker_id)
        self.metrics = WorkerMetrics(self.stats, adapter_label_cap=config.metrics_max_adapters)
        self.scheduler.observer = self.metrics
        self._lock = threading.Lock()
        self._draining: set[int] = set()
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
    def load_adapter(self, adapter_id: int, *, sha256: str = "", path: str = "", data: bytes = b"") -> LoraAdapter:
        """Load and register an adapter under the id the control plane assigned.

        Raises:
            InvalidRequestError: bad file, hash mismatch, neither path nor bytes.
            AdapterConflictError: the id is held by different content.
            AdapterNotFoundError: no file at the path.
        """
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
        if held is not None:
            if sha256 and held.sha256 != sha256:
                raise AdapterConflictError(f"adapter id {adapter_id} is loaded with other content ({held.sha256})")
            return held
        try:
            adapter = load_lora_adapter(path, base_arch=self.base.arch, base_tensors=self.base.tensor_ne,
                                        device_for=self.base.device_of, dtype=self.base.dtype)
        except AdapterError as exc:
            raise InvalidRequestError(str(exc)) from exc
        if sha256 and adapter.sha256 != sha256:
            raise InvalidRequestError(f"adapter {adapter_id}: sha256 mismatch (expected {sha256}, got {adapter.sha256})")
        with self._lock:
            self.model.adapters.add(adapter_id, adapter)
            self._draining.discard(adapter_id)
        self.metrics.on_adapter_loaded()
        log.info("adapter loaded", adapter_id=adapter_id, name=adapter.name, pairs=len(adapter.pairs))
        return adapter

    def unload_adapter(self, adapter_id: int, timeout_s: float = 60.0) -> None:
        """Drain then free ``adapter_id`` (refuses new requests for it at once).

        Raises:
            AdapterNotFoundError: not loaded.
            DrainTimeoutError: requests still running after ``timeout_s``.
        """
        with self._lock:
            if adapter_id not in self.model.adapters.by_id:
                raise AdapterNotFoundError(f"adapter {adapter_id} is not loaded on worker {self.worker_id} "
                                               f"(loaded: {sorted(self.model.adapters.by_id)})")
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
            self.model.adapters.free(adapter_id)
            self._draining.discard(adapter_id)
        self.metrics.on_adapter_freed()
        log.info("adapter freed", adapter_id=adapter_id)

    def draining_ids(self) -> set[int]:
        """Adapters being unloaded: refused for new requests, freed once idle."""
        with self._lock:
            return set(self._draining)

    def adapters(self) -> dict[int, LoraAdapter]:
        with self._lock:
            return dict(self.model.adapters.by_id)

    # --- requests -------------------------------------------------------------------------
    def resolve_set(self, entries: list[tuple[int, float]]) -> AdapterSet:
        """Turn a resolved adapter vector into an ``AdapterSet`` (zero scales dropped).

        Raises:
            AdapterNotFoundError: adapter not loaded or being unloaded.
            InvalidRequestError: non-finite scale, duplicate id.
        """
        seen: dict[int, tuple[LoraAdapter, float]] = {}
        with self._lock:
            loaded = self.model.adapters.by_id
            for aid, scale in entries:
                if not math.isfinite(scale):
                    raise InvalidRequestError(f"adapter {aid}: scale {scale} is not finite")
                if aid in seen:
                    raise InvalidRequestError(f"adapter {aid} appears twice in the adapter vector")
                if scale == 0.0:
                    continue
                if aid not in loaded or aid in self._draining:
                    raise AdapterNotFoundError(f"adapter {aid} is not loaded on worker {self.worker_id} "
                                                   f"(loaded: {sorted(i for i in loaded if i not in self._draining)})")
                seen[aid] = (loaded[aid], scale)
        return AdapterSet.of(seen)

    def submit(self, *, request_id: str, prompt_tokens: list[int] | None, prompt_text: str | None,
               params: SamplingParams, entries: list[tuple[int, float]],
               emit: Callable[[Event], None]) -> GenRequest:
        """Tokenize (text prompts: BOS per the model, special tokens parsed), resolve the
        adapter set and admit the request.

        Raises:
            WorkerError: a subclass naming the outcome (``worker.errors``).
        """
        try:
            if prompt_tokens is None:
                prompt_tokens = self.tokenize(prompt_text or "")
            adapter_set = self.resolve_set(entries)
            return self.scheduler.submit(request_id=request_id, prompt=prompt_tokens, params=params,
                                         adapter_set=adapter_set, emit=emit)
        except WorkerError:
            self.metrics.on_rejected(tuple(sorted(i for i, s in entries if s != 0.0)))
            raise

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
                f"{self.max_prompt_bytes} bytes can fit (refused before tokenizing)")
        with self._tokenize_lock:
            return self.base.tokenizer.encode(text, add_special=True, parse_special=True)

    def stats(self) -> WorkerStatsRecord:
        """Scheduler counters plus the worker's identity, model and adapter footprint."""
        ads = self.adapters()
        adapter_bytes = sum(p.lora_a.numel() * p.lora_a.element_size() + p.lora_b.numel() * p.lora_b.element_size()
                            for a in ads.values() for p in a.pairs.values())
        return WorkerStatsRecord(
            worker_id=self.worker_id, batching=self.config.batching.value,
            prefix_cache=self.config.prefix_cache.value, model=str(self.base.path),
            device=str(self.base.device), dtype=self.config.dtype, adapter_ids=sorted(ads),
            node_budget=self.ctx.node_budget, adapter_bytes=adapter_bytes, scheduler=self.scheduler.stats())


__all__ = ["WorkerEngine", "WorkerStatsRecord"]
