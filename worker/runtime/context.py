"""A worker context: the base model, the active adapter sets, the plan cache and the KV cache.

Mirrors llama.cpp ``llama_context``: ``set_adapters`` is ``llama_set_adapters_lora`` (a no-op
when the sets are unchanged — ``adapters_lora_are_same`` — otherwise it swaps them in, making
every adapter of the new sets resident in the model's slot pool, ``loraplane.worker.lora.pool``; the
context holds no slot: whoever decodes keeps the adapters held until then, as the scheduler's
admitted requests do), and
``decode`` is ``llama_decode`` over one ubatch of
``(token, pos, seq_id, wants_logits)`` rows from any number of sequences. Prompt processing
and single-token decode take the same path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loraplane.worker.lora.adapter import AdapterError
from loraplane.worker.lora.adapter_set import EMPTY_SET, AdapterSet
from loraplane.worker.lora.plan import LoraPlan, build_plan
from loraplane.worker.lora.pool import LoraPool, PoolCapacityError, PoolExhaustedError
from loraplane.worker.lora.registry import ModelAdapters
from loraplane.worker.runtime import arch as arch_registry
from loraplane.worker.runtime.graph import DecodeRows, GraphContext, GraphInputs, SeqSpan
from loraplane.worker.runtime.kv_cache import KVCache, KVCacheError
from loraplane.worker.runtime.model import LoadedModel


class DecodeError(ValueError):
    """A ubatch is malformed (names the row / sequence at fault)."""


@dataclass
class UBatch:
    """One ubatch (llama.cpp ``llama_batch``): parallel lists, one entry per token row.

    ``set_index[i]`` selects the row's adapter set among the context's active sets
    (mixed batching); None means set 0 for every row.
    """

    tokens: list[int]
    pos: list[int]
    seq_ids: list[int]
    logits: list[bool]
    set_index: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class DecodeResult:
    """Logits f32 ``(n_out, n_vocab)`` for the rows that asked for them, in row order."""

    logits: torch.Tensor
    out_rows: list[int]
    graph_reused: bool
    n_nodes: int
    n_adapter_sets: int


@dataclass
class ContextStats:
    """``graph_reuses``: decodes in which no slot's content had changed since the previous
    decode; ``graph_rebuilds``: decodes after a page-in or eviction."""

    graph_reuses: int = 0
    graph_rebuilds: int = 0
    decode_calls: int = 0
    tokens_computed: int = 0


class WorkerContext:
    """Holds the model, the active adapter sets, the plan ("graph") cache and the KV cache.

    Args:
        model: loaded base model.
        adapters: the model's adapter registry (shared by all contexts of the model).
        n_ctx_seq: KV positions per sequence.
        n_seq: sequences expected at once (slots); the KV cache makes room for them up front.
    """

    def __init__(self, model: LoadedModel, adapters: ModelAdapters, *, n_ctx_seq: int = 4096, n_seq: int = 1):
        self.model = model
        self.adapters = adapters
        self.arch = arch_registry.get(model.arch, model.path)
        hp = model.hparams
        self.kv = KVCache(
            n_layer=hp.n_layer,
            n_head_kv=hp.n_head_kv,
            n_embd_head_k=hp.n_embd_head_k,
            n_embd_head_v=hp.n_embd_head_v,
            n_ctx_seq=n_ctx_seq,
            dtype=model.dtype,
            device=model.device,
            n_seq_hint=n_seq,
        )
        self._key_pos = torch.arange(n_ctx_seq, dtype=torch.long, device=model.device)  # key positions, sliced
        self.active_sets: tuple[AdapterSet, ...] = (EMPTY_SET,)
        self.pool: LoraPool = adapters.pool
        self._seen_generation = -1  # pool generation at the previous decode
        self.stats = ContextStats()
        adapters.contexts.append(self)

    def close(self) -> None:
        """Detach from the model (contexts go before models)."""
        if self in self.adapters.contexts:
            self.adapters.contexts.remove(self)
        self.kv.clear()

    # --- adapters -------------------------------------------------------------------------
    def set_adapters(self, sets: AdapterSet | Sequence[AdapterSet]) -> bool:
        """Make ``sets`` the active adapter sets; returns True when they changed.

        Unchanged (same adapters by content, same non-zero scales) → no-op. Changed → every
        adapter of ``sets`` is made resident in the slot pool (paging in what is missing,
        evicting least recently used unheld slots) and marked recently used. The context
        holds no slot: the caller keeps them held until ``decode`` when anything else may
        page in between (the scheduler's requests hold theirs from admission); ``decode``
        pages in again what went meanwhile. Only a page-in changes slot content; changing
        sets alone costs nothing.

        Raises:
            DecodeError: an adapter is not registered, or the sets need more slots than can be
                free now (``max_loras``, or every slot held/pinned).
        """
        new = (sets,) if isinstance(sets, AdapterSet) else tuple(sets) or (EMPTY_SET,)
        if new == self.active_sets:
            return False
        for s in new:
            for aid, a, _ in s.entries:
                if self.adapters.by_id.get(aid) is not a:
                    raise DecodeError(
                        f"adapter {aid} ('{a.name}') is not registered with this model "
                        f"(registered: {sorted(self.adapters.by_id)})"
                    )
        self._make_resident(new)
        self.active_sets = new
        return True

    def _make_resident(self, sets: Sequence[AdapterSet]) -> None:
        """Page in every adapter of ``sets`` that is not resident, holding nothing afterwards.

        Raises:
            DecodeError: they cannot all be resident now, or a file cannot be re-read.
        """
        wanted = [a for s in sets for _, a, _ in s.entries]
        try:
            self.pool.acquire(wanted)
        except (PoolCapacityError, PoolExhaustedError) as exc:
            raise DecodeError(f"adapter sets need slots: {exc}") from exc
        except AdapterError as exc:  # a file-backed adapter's tensors could not be re-read
            raise DecodeError(f"paging an adapter in failed: {exc}") from exc
        self.pool.release(wanted)

    @property
    def node_budget(self) -> int:
        """Worst-case graph nodes (``ModelAdapters.node_budget``)."""
        return self.adapters.node_budget()

    def _get_plan(self) -> tuple[LoraPlan, bool]:
        """The ubatch's routing over the pool, and whether no slot changed since the last decode
        ("graph reused")."""
        gen = self.pool.generation
        plan = build_plan(self.active_sets, self.pool)
        reused = gen == self._seen_generation
        self._seen_generation = gen
        if reused:
            self.stats.graph_reuses += 1
        else:
            self.stats.graph_rebuilds += 1
        return plan, reused

    # --- decode ---------------------------------------------------------------------------
    def _inputs(self, ub: UBatch, set_index: list[int]) -> GraphInputs:
        n = len(ub)
        if n == 0:
            raise DecodeError("empty ubatch")
        if not (len(ub.pos) == len(ub.seq_ids) == len(ub.logits) == n):
            raise DecodeError("ubatch fields differ in length")
        n_vocab = self.model.n_vocab
        for i, t in enumerate(ub.tokens):
            if not 0 <= t < n_vocab:
                raise DecodeError(f"row {i}: token id {t} out of range [0, {n_vocab})")
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(ub.seq_ids):
            groups.setdefault(s, []).append(i)
        dev = self.model.device
        spans = []
        for seq, rows in groups.items():
            pos0 = ub.pos[rows[0]]
            if [ub.pos[r] for r in rows] != list(range(pos0, pos0 + len(rows))):
                raise DecodeError(f"seq {seq}: positions in the ubatch are not consecutive")
            try:
                self.kv.begin_append(seq, pos0, len(rows))
            except KVCacheError as exc:
                raise DecodeError(str(exc)) from exc
            spans.append(SeqSpan(seq, torch.tensor(rows, dtype=torch.long, device=dev), pos0, len(rows)))
        out_rows = [i for i, w in enumerate(ub.logits) if w]
        return GraphInputs(
            decode_rows=self._decode_rows(ub, groups),
            tokens=torch.tensor(ub.tokens, dtype=torch.long, device=dev),
            pos=torch.tensor(ub.pos, dtype=torch.long, device=dev),
            spans=spans,
            out_rows=torch.tensor(out_rows, dtype=torch.long, device=dev),
            row_set=torch.tensor(set_index, dtype=torch.long, device=dev),
        )

    def _decode_rows(self, ub: UBatch, groups: dict[int, list[int]]) -> DecodeRows | None:
        """The one-row sequences, ordered by KV-cache row (for the batched decode attention).

        Every one-row sequence takes that path, even alone, so a decode row's attention is the
        same computation whatever else shares its ubatch (mixed vs compat batching, batched vs
        alone): the per-span path sums in another order, and on the packed default path that
        last-bit difference can move int16 activation roundings downstream.
        """
        single = sorted((self.kv.row_of[seq], rows[0]) for seq, rows in groups.items() if len(rows) == 1)
        if not single:
            return None
        dev = self.model.device
        cache_rows = [r for r, _ in single]
        pos = [ub.pos[i] for _, i in single]
        first = cache_rows[0]
        contiguous = cache_rows == list(range(first, first + len(cache_rows)))
        return DecodeRows(
            rows=torch.tensor([i for _, i in single], dtype=torch.long, device=dev),
            cache_rows=torch.tensor(cache_rows, dtype=torch.long, device=dev),
            pos=torch.tensor(pos, dtype=torch.long, device=dev),
            pos_min=min(pos),
            pos_max=max(pos),
            key_pos=self._key_pos,
            contiguous_from=first if contiguous else None,
        )

    @torch.inference_mode()
    def decode(self, ub: UBatch) -> DecodeResult:
        """Run one ubatch; append its K/V; return logits of the rows with ``logits=True``.

        Raises:
            DecodeError: malformed ubatch (token out of range, positions that do not continue
                their sequence, set index out of range), or an active adapter evicted since
                ``set_adapters`` cannot be paged in again; nothing is written to the KV cache.
        """
        n_sets = len(self.active_sets)
        set_index = ub.set_index or [0] * len(ub)
        if any(not 0 <= j < n_sets for j in set_index):
            raise DecodeError(f"set_index out of range: {n_sets} active adapter sets")
        if any(self.pool.slot_of(a.sha256) is None for s in self.active_sets for _, a, _ in s.entries):
            self._make_resident(self.active_sets)  # evicted since set_adapters (nothing held them)
        inputs = self._inputs(ub, set_index)
        plan, reused = self._get_plan()
        gctx = GraphContext(self.model.weights, inputs, plan, self.kv, self.model.dtype, self.model.fused)
        logits = self.arch.build_graph(gctx, self.model.hparams)
        for span in inputs.spans:
            self.kv.commit(span.seq_id, span.pos0 + span.n)
        self.stats.decode_calls += 1
        self.stats.tokens_computed += len(ub)
        return DecodeResult(logits.float(), inputs.out_rows.tolist(), reused, gctx.n_nodes, len({s for s in set_index}))


@dataclass
class Model:
    """A base model with its adapter registry and slot pool (what a worker process holds).

    ``max_loras`` / ``max_lora_rank``: the pool's slots and largest rank (``--max-loras``,
    ``--max-lora-rank``; vLLM's names and defaults).
    """

    base: LoadedModel
    max_loras: int = 16
    max_lora_rank: int = 64
    adapters: ModelAdapters = field(init=False)

    def __post_init__(self) -> None:
        pool = LoraPool(self.max_loras, self.max_lora_rank, dtype=self.base.dtype, device_for=self.base.device_of)
        self.adapters = ModelAdapters(self.base.n_base_tensors, pool)

    def new_context(self, *, n_ctx_seq: int = 4096, n_seq: int = 1, engine: str | None = None) -> WorkerContext:
        """A context over this model (``n_ctx_seq`` KV positions per sequence, room for
        ``n_seq`` sequences); it shares the model's adapters and slot pool.

        ``engine``: "cpu" (this module's context), "gpu" (``loraplane.worker.gpu.context``:
        paged KV, Triton kernels, CUDA graphs; on a CPU device it runs under Triton's
        interpreter with capture off) or None: ``$LORAPLANE_ENGINE`` if set, else "gpu" on a
        CUDA device and "cpu" elsewhere.

        Raises:
            ValueError: another engine name.
        """
        want = engine or os.environ.get("LORAPLANE_ENGINE") or ("gpu" if self.base.device.type == "cuda" else "cpu")
        if want == "gpu":
            from loraplane.worker.gpu.context import GpuWorkerContext  # the GPU engine, imported on use

            return GpuWorkerContext(self.base, self.adapters, n_ctx_seq=n_ctx_seq, n_seq=n_seq)
        if want != "cpu":
            raise ValueError(f"unknown engine '{want}' (expected cpu or gpu)")
        return WorkerContext(self.base, self.adapters, n_ctx_seq=n_ctx_seq, n_seq=n_seq)
