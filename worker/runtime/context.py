"""A worker context: the base model, the active adapter sets, the plan cache and the KV cache.

Mirrors llama.cpp ``llama_context``: ``set_adapters`` is ``llama_set_adapters_lora`` (a no-op
when the sets are unchanged — ``adapters_lora_are_same`` — otherwise it swaps them in, making
every adapter of the new sets resident in the model's slot pool, ``worker.lora.pool``; the
context holds no slot: whoever decodes keeps the adapters held until then, as the scheduler's
admitted requests do), and
``decode`` is ``llama_decode`` over one ubatch of
``(token, pos, seq_id, wants_logits)`` rows from any number of sequences. Prompt processing
and single-token decode take the same path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from loraplane.env import ENV_ENGINE
from worker.lora.pool import LoraPool
from worker.lora.registry import ModelAdapters
from worker.runtime import arch as arch_registry
from worker.runtime.context_base import (  # the engines' shared types, re-exported
    AdapterContext,
    DecodeError,
    DecodeResult,
    UBatch,
)
from worker.runtime.graph import DecodeRows, GraphContext, GraphInputs, SeqSpan
from worker.runtime.kv_cache import KVCache, KVCacheError, kv_cache_dtype
from worker.runtime.model import LoadedModel


class WorkerContext(AdapterContext):
    """The CPU engine's context: the model, the active adapter sets, the plan ("graph") cache
    (``AdapterContext``) and the KV cache.

    Args:
        model: loaded base model.
        adapters: the model's adapter registry (shared by all contexts of the model).
        n_ctx_seq: KV positions per sequence.
        n_seq: sequences expected at once (``--slots``); the KV cache makes room for them up front.
        kv_dtype: ``--kv-cache-dtype`` name, "auto" (f16 on the packed path under f32 compute,
            as llama.cpp) or f32 / f16 / bf16 (``worker.runtime.kv_cache.kv_cache_dtype``).

    Raises:
        ValueError: an unknown ``kv_dtype`` name.
    """

    kv: KVCache

    def __init__(
        self,
        model: LoadedModel,
        adapters: ModelAdapters,
        *,
        n_ctx_seq: int = 4096,
        n_seq: int = 1,
        kv_dtype: str = "auto",
    ):
        self.arch = arch_registry.get(model.arch, model.path)
        hp = model.hparams
        self.kv = KVCache(
            n_layer=hp.n_layer,
            n_head_kv=hp.n_head_kv,
            n_embd_head_k=hp.n_embd_head_k,
            n_embd_head_v=hp.n_embd_head_v,
            n_ctx_seq=n_ctx_seq,
            dtype=kv_cache_dtype(kv_dtype, model.dtype, model.weight_form),
            device=model.device,
            n_seq_hint=n_seq,
        )
        self._key_pos = torch.arange(n_ctx_seq, dtype=torch.long, device=model.device)  # key positions, sliced
        super().__init__(model, adapters)

    def _close_kv(self) -> None:
        self.kv.clear()

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
        gctx = GraphContext(
            self.model.weights, inputs, plan, self.kv, self.model.dtype, self.model.fused, self.model.layer_kernels
        )
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

    def new_context(
        self, *, n_ctx_seq: int = 4096, n_seq: int = 1, engine: str | None = None, kv_dtype: str = "auto"
    ) -> AdapterContext:
        """A context over this model (``n_ctx_seq`` KV positions per sequence, room for
        ``n_seq`` sequences); it shares the model's adapters and slot pool.

        ``kv_dtype``: ``--kv-cache-dtype``, the CPU KV cache's storage ("auto": f16 on the
        packed path under f32 compute, as llama.cpp; ``worker.runtime.kv_cache.kv_cache_dtype``). The GPU engine
        takes only "auto" (its paged cache: f16 under 16-bit compute, f32 under f32).

        ``engine``: "cpu" (this module's context), "gpu" (``worker.gpu.context``:
        paged KV, Triton kernels, CUDA graphs; on a CPU device it runs under Triton's
        interpreter with capture off) or None: ``$LORAPLANE_ENGINE`` if set, else "gpu" on a
        CUDA device and "cpu" elsewhere.

        Raises:
            ValueError: another engine name, an unknown ``kv_dtype``, or one other than "auto"
                for the GPU engine.
        """
        want = engine or os.environ.get(ENV_ENGINE) or ("gpu" if self.base.device.type == "cuda" else "cpu")
        if want == "gpu":
            from worker.gpu.context import GpuWorkerContext  # the GPU engine, imported on use

            if kv_dtype != "auto":
                raise ValueError(
                    f"--kv-cache-dtype {kv_dtype}: the GPU engine's paged KV cache takes only 'auto' "
                    "(f16 under 16-bit compute, f32 under f32)"
                )

            return GpuWorkerContext(self.base, self.adapters, n_ctx_seq=n_ctx_seq, n_seq=n_seq)
        if want != "cpu":
            raise ValueError(f"unknown engine '{want}' (expected cpu or gpu)")
        return WorkerContext(self.base, self.adapters, n_ctx_seq=n_ctx_seq, n_seq=n_seq, kv_dtype=kv_dtype)
