"""The GPU engine's context: the forward pass of ``worker.runtime.arch`` on the device, its
decode steps replayed as CUDA graphs.

`GpuWorkerContext` is what a CUDA worker runs instead of ``worker.runtime.context.WorkerContext``
(chosen by ``Model.new_context``): the CPU context's contract (``set_adapters``,
``decode(UBatch)`` → ``DecodeResult``, ``kv``) over a paged KV cache (``worker.gpu.kv.PagedKV``),
decode-only ubatches through ``worker.gpu.graph_runner.GraphRunner``, two graph sets (without
and with LoRA launches). `GpuGraphContext` overrides the graph blocks whose CPU forms do not fit
the device: cuBLAS matmuls of the ``device-dense`` weights with f32 output (`MM_OUTPUT`), LoRA
by ``worker.gpu.kernels.lora.add_lora``, attention by ``worker.gpu.kernels.attention``; the
residual stream is `STREAM_DTYPE`.

What runs where, when graphs are captured, what runs eagerly: docs/gpu.md, "Inside the GPU
engine".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog
import torch

from loraplane.env import ENV_GPU_MM
from worker.gpu.graph_runner import CudaGraphStats, GraphRunner, HostStep, Outputs, StepInputs
from worker.gpu.kernels.attention import kv_write, paged_decode_attention, prefill_attention
from worker.gpu.kernels.lora import add_lora
from worker.gpu.kv import PagedKV
from worker.lora.plan import LoraPlan
from worker.lora.registry import ModelAdapters
from worker.runtime import arch as arch_registry
from worker.runtime.context_base import AdapterContext, DecodeError, DecodeResult, UBatch
from worker.runtime.graph import GraphContext, GraphInputs, SeqSpan
from worker.runtime.kv_cache import KVCacheError
from worker.runtime.model import LoadedModel

log = structlog.get_logger("loraplane.worker.gpu.context")

STREAM_DTYPE = torch.float32
"""The residual stream, norms, rope and logits: f32 whatever the weights' dtype."""

MM_OUTPUT = os.environ.get(ENV_GPU_MM, "round")
"""How a 16-bit matmul leaves cuBLAS: ``round`` (default) writes the compute dtype and casts to
f32 (cuBLAS's tensor-core GEMMs; accumulation is f32 either way); ``f32`` asks for f32 output
(``torch.mm(..., out_dtype=float32)``: one rounding less, measured slower on an H200, see
bench/RESULTS.md)."""


def kv_dtype(dtype: torch.dtype) -> torch.dtype:
    """The paged KV cache's dtype for a compute dtype: f16 for both 16-bit ones (llama.cpp's
    default ``type_k``/``type_v``: 10 mantissa bits where bf16 has 7; K and V of the models we
    serve stay far below f16's range), f32 for f32."""
    return torch.float32 if dtype == torch.float32 else torch.float16


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with f32 output: x ``(n, k)`` any float dtype (cast to w's), w ``(d, k)`` →
    f32 ``(n, d)``; accumulated in f32, rounded to w's dtype on the way out unless
    :data:`MM_OUTPUT` is ``f32`` (then written in f32 on CUDA)."""
    xw = x if x.dtype == w.dtype else x.to(w.dtype)
    if MM_OUTPUT == "f32" and w.dtype != torch.float32 and w.device.type == "cuda":
        try:
            return torch.mm(xw, w.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    return (xw @ w.T).float()


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` as f32 on the host: on CUDA through page-locked memory (torch's caching host
    allocator), one asynchronous copy and a wait for it; a pageable copy of B=16 rows of a
    152k vocabulary took 7.5 ms on an H200, the pinned one runs at the link's rate."""
    x = x.float()
    if x.device.type != "cuda":
        return x
    dst = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    dst.copy_(x, non_blocking=True)
    torch.cuda.current_stream(x.device).synchronize()
    return dst


class GpuGraphContext(GraphContext):
    """One step's forward pass on the device (module docstring).

    Args:
        model: the loaded model (``device-dense`` weights).
        step: the step's device inputs (``StepInputs``: token ids, positions, slot mapping,
            per-row LoRA slot scales f32 ``(n, max_loras)``, block tables, sequence lengths).
        kv: the paged KV cache.
        pool_weights: the adapter slot pool's buffers by weight name (``LoraPool.weights``), or
            None for a step without LoRA.
        plan: the step's LoRA plan (side branches, eager steps only), or None.
        spans: the sequences of an eager step (host ints), None for a decode step (one row
            per sequence, in block-table order).
        out_rows: int64 ``(n_out,)`` rows whose logits are wanted; None = every row.
    """

    takes_layer_kernel = False  # the paged KV cache and the device blocks; never the CPU layer kernel

    def __init__(
        self,
        model: LoadedModel,
        step: StepInputs,
        kv: PagedKV,
        *,
        pool_weights: dict[str, Any] | None,
        plan: LoraPlan | None,
        spans: list[SeqSpan] | None,
        out_rows: torch.Tensor | None = None,
    ):
        n = step.n_tokens
        inputs = GraphInputs(
            tokens=step.token_ids,
            pos=step.positions,
            spans=spans or [],
            out_rows=out_rows if out_rows is not None else torch.arange(n, device=step.token_ids.device),
            row_set=step.token_ids,  # unused: the slot scales come in ``step.lora_scales``
        )
        self.w = model.weights
        self.fused = {}
        self.fused_dense = model.fused_dense
        self.inp = inputs
        self.plan = plan  # type: ignore[assignment]
        self.kv = kv  # type: ignore[assignment]
        self.dtype = STREAM_DTYPE
        self.step = step
        self.pool_weights = pool_weights or {}
        self.row_slot = step.lora_scales if pool_weights else None
        self._rows_reduced = False
        self._pairs = None
        self._lora_rank = {}
        self._rope_cache = {}
        self.n_nodes = 0
        self._spans = spans

    def side_branches(self, name: str) -> list:
        if self.row_slot is None or self.plan is None:
            return []
        return super().side_branches(name)

    # --- matmuls and LoRA ---------------------------------------------------------------
    def base_mm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` in f32 (:func:`_mm`)."""
        return _mm(x, self.w[name])

    def _add_lora(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y += Σ_s S[:, s] · factor_s · B_s (A_s x)`` over every slot of the pool (Triton,
        ``add_lora``; slots a row does not use have scale 0 and are skipped on the device)."""
        if self.row_slot is None:
            return y
        w = self.pool_weights.get(name)
        if w is None:
            return y
        self.n_nodes += 4
        xa = x if x.dtype == w.a.dtype else x.to(w.a.dtype)
        return add_lora(xa, y, w.a, w.bt, w.factor, self.row_slot)

    def build_lora_mm_group(self, names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor]:
        """``build_lora_mm`` of weights that read the same ``x``: one product when they were
        loaded as one tensor (``fused_dense``), split into column views; each view gets its
        LoRA in place."""
        fused = self.fused_dense.get(tuple(names))
        if fused is not None:
            y = _mm(x, fused)
            out = list(torch.split(y, [int(self.w[n].shape[0]) for n in names], dim=-1))
        else:
            out = [self.base_mm(n, x) for n in names]
        for i, name in enumerate(names):
            self.n_nodes += 1
            out[i] = self._add_lora(name, x, out[i])
        return out

    def build_lora_mm_id(self, name: str, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """The routed expert matmul of ``GraphContext.build_lora_mm_id`` on the weights' dtype,
        returned in f32 (eager only: it reads the chosen experts on the host)."""
        w = self.w[name]
        if isinstance(w, torch.Tensor) and x.dtype != w.dtype:
            x = x.to(w.dtype)
        return super().build_lora_mm_id(name, x, expert_ids).float()

    def build_norm(self, x: torch.Tensor, name: str, eps: float) -> torch.Tensor:
        """RMS norm in f32 (``LLM_NORM_RMS``): ``x / sqrt(mean(x²) + eps) · w``."""
        self.n_nodes += 2
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return y * self.w[name]

    # --- attention ------------------------------------------------------------------------
    def build_attn(
        self,
        il: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        wo: str,
        kq_scale: float,
        n_swa: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Write this step's K/V into the pages, attend, project with ``wo`` (the semantics of
        ``GraphContext.build_attn``). q ``(n, H, dk)``, k ``(n, Hkv, dk)``, v ``(n, Hkv, dv)``."""
        n, n_head, _ = q.shape
        kc, vc = self.kv.k[il], self.kv.v[il]
        kv_write(kc, vc, self.step.slot_mapping, k, v)
        qc = q.to(kc.dtype)
        if self._spans is None:  # decode: row b is sequence b
            out = paged_decode_attention(
                qc, kc, vc, self.step.block_tables, self.step.seq_lens, scale=kq_scale, window=n_swa, softcap=softcap
            )
        else:
            out = torch.empty((n, n_head, vc.shape[-1]), dtype=qc.dtype, device=q.device)
            for i, span in enumerate(self._spans):
                table = self.step.block_tables[i]
                o = prefill_attention(
                    qc.index_select(0, span.rows),
                    kc,
                    vc,
                    table,
                    span.pos0,
                    scale=kq_scale,
                    window=n_swa,
                    softcap=softcap,
                )
                out.index_copy_(0, span.rows, o)
        self.n_nodes += 8
        return self.build_lora_mm(wo, out.reshape(n, -1))


class GpuWorkerContext(AdapterContext):
    """``worker.runtime.context.WorkerContext``'s contract on a CUDA device (module
    docstring).

    Args:
        model: loaded base model on the device (``device-dense``).
        adapters: the model's adapter registry (its slot pool holds device buffers).
        n_ctx_seq: KV positions per sequence.
        n_seq: sequences at once (the largest decode bucket).
        capture: capture CUDA graphs for decode steps (False: every step eager through the
            same static buffers; the CPU under Triton's interpreter).
    """

    def __init__(
        self,
        model: LoadedModel,
        adapters: ModelAdapters,
        *,
        n_ctx_seq: int = 4096,
        n_seq: int = 1,
        capture: bool = True,
    ):
        if model.weight_form == "packed":
            raise ValueError(
                f"{model.path}: the GPU engine multiplies dense weights; this model was loaded 'packed' "
                "(load it with weights='device-dense' or 'dequant', as a CUDA device does by default)"
            )
        self.arch = arch_registry.get(model.arch, model.path)
        hp = model.hparams
        self.paged = PagedKV(
            n_layer=hp.n_layer,
            n_head_kv=hp.n_head_kv,
            n_embd_head_k=hp.n_embd_head_k,
            n_embd_head_v=hp.n_embd_head_v,
            n_ctx_seq=n_ctx_seq,
            n_seq=n_seq,
            dtype=kv_dtype(model.dtype),
            device=model.device,
        )
        self.kv = self.paged  # KVCache's interface (worker.gpu.kv)
        self.max_slots = max(1, n_seq)
        self.moe = getattr(hp, "n_expert", 0) > 0
        # MoE routing reads its expert ids on the host (torch.unique): those models run eagerly
        self.capture = capture and model.device.type == "cuda" and not self.moe
        self._runners: dict[tuple[Any, ...], GraphRunner] = {}
        self._retired = CudaGraphStats()  # eager steps, and the counts of runners dropped after a layout change
        super().__init__(model, adapters)
        self._runner(lora=False)

    def close(self) -> None:
        super().close()
        self._runners.clear()

    def _close_kv(self) -> None:
        self.paged.clear()

    # --- graphs -----------------------------------------------------------------------------
    @property
    def cuda_graph_stats(self) -> CudaGraphStats:
        """CUDA graphs captured, replayed, and eager fallbacks, over every runner so far."""
        total = CudaGraphStats(**vars(self._retired))
        for r in self._runners.values():
            for k, v in vars(r.stats).items():
                setattr(total, k, getattr(total, k) + v)
        return total

    def graph_counts(self) -> dict[str, int]:
        """``cuda_graph_stats`` by name, for the scheduler's stats and /metrics."""
        return dict(vars(self.cuda_graph_stats))

    def _layout(self) -> tuple[Any, ...]:
        """What a LoRA graph depends on besides its inputs: the pool's buffer objects."""
        return tuple((name, w.a.data_ptr(), w.bt.data_ptr(), tuple(w.a.shape)) for name, w in self.pool.weights.items())

    def _runner(self, *, lora: bool) -> GraphRunner:
        key: tuple[Any, ...] = ("lora", self._layout()) if lora else ("base",)
        runner = self._runners.get(key)
        if runner is not None:
            return runner
        if lora:  # a new layout: the old LoRA graphs read buffers that may be gone
            for old in [k for k in self._runners if k[0] == "lora"]:
                gone = self._runners.pop(old)
                for k, v in vars(gone.stats).items():
                    setattr(self._retired, k, getattr(self._retired, k) + v)
        weights = dict(self.pool.weights) if lora else None
        runner = GraphRunner(
            lambda s: self._forward(s, weights),
            max_slots=self.max_slots,
            max_loras=self.pool.max_loras,
            max_blocks_per_seq=self.paged.pages.max_blocks_per_seq,
            device=self.model.device,
            capture=self.capture,
        )
        self._runners[key] = runner
        if self.capture:
            runner.capture_all()
            log.info("cuda_graphs_captured", buckets=list(runner.sizes), graph_set=key[0])
        return runner

    def _forward(self, step: StepInputs, weights: dict[str, Any] | None) -> Outputs:
        gctx = GpuGraphContext(self.model, step, self.paged, pool_weights=weights, plan=None, spans=None)
        return {"logits": self.arch.build_graph(gctx, self.model.hparams)}

    # --- decode -------------------------------------------------------------------------------
    def _check(self, ub: UBatch) -> dict[int, list[int]]:
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
        for seq, rows in groups.items():
            pos0 = ub.pos[rows[0]]
            if [ub.pos[r] for r in rows] != list(range(pos0, pos0 + len(rows))):
                raise DecodeError(f"seq {seq}: positions in the ubatch are not consecutive")
            try:
                self.paged.begin_append(seq, pos0, len(rows))
            except KVCacheError as exc:
                raise DecodeError(str(exc)) from exc
        return groups

    @torch.inference_mode()
    def decode(self, ub: UBatch) -> DecodeResult:
        """Run one ubatch on the device; append its K/V; return f32 logits of the rows with
        ``logits=True`` (on the host: the scheduler's samplers read them there).

        Raises:
            DecodeError: as ``WorkerContext.decode``; also when the KV pages are full. Nothing is
                kept in the KV cache of a ubatch that fails.
        """
        n_sets = len(self.active_sets)
        set_index = ub.set_index or [0] * len(ub)
        if any(not 0 <= j < n_sets for j in set_index):
            raise DecodeError(f"set_index out of range: {n_sets} active adapter sets")
        if any(self.pool.slot_of(a.sha256) is None for s in self.active_sets for _, a, _ in s.entries):
            self._make_resident(self.active_sets)
        groups = self._check(ub)
        plan, reused = self._get_plan()
        n = len(ub)
        slot_mapping = np.empty(n, dtype=np.int64)
        before = {seq: self.paged.seq_len(seq) for seq in groups}
        rows_of: list[int] = []
        try:
            for seq, rows in groups.items():
                row, slots = self.paged.reserve(seq, len(rows))
                slot_mapping[rows] = slots
                rows_of.append(row)
        except KVCacheError as exc:
            self._rollback(before)
            raise DecodeError(str(exc)) from exc
        self.paged.pages.sync()
        lora_scales = np.zeros((n, self.pool.max_loras), dtype=np.float32)
        if not plan.empty:
            per_set = plan.set_slot_scale.numpy()
            lora_scales[:, : plan.s_used] = per_set[np.asarray(set_index)]
        use_lora = bool(lora_scales.any())
        out_rows = [i for i, w in enumerate(ub.logits) if w]
        decode_only = len(groups) == n
        try:
            if decode_only and not self.moe and not (use_lora and plan.side_slots) and n <= self.max_slots:
                order = [rows[0] for rows in groups.values()]  # ubatch row of block-table row b
                tables = self.paged.table_rows(rows_of)
                step = HostStep.decode(
                    token_ids=np.asarray([ub.tokens[i] for i in order], dtype=np.int64),
                    positions=np.asarray([ub.pos[i] for i in order], dtype=np.int64),
                    slot_mapping=slot_mapping[order],
                    lora_scales=lora_scales[order],
                    block_tables=tables,
                    seq_lens=np.asarray([ub.pos[i] + 1 for i in order], dtype=np.int32),
                )
                logits = self._runner(lora=use_lora).run(step)["logits"]
                inv = np.empty(n, dtype=np.int64)
                inv[order] = np.arange(n)
                want = inv[out_rows] if len(out_rows) != n or order != list(range(n)) else None
                host = _to_host(logits if want is None else logits.index_select(0, self._dev(want)))
                n_nodes = 0
            else:
                host, n_nodes = self._eager(ub, groups, rows_of, slot_mapping, lora_scales, plan, use_lora, out_rows)
        except Exception:
            self._rollback(before)
            raise
        self.stats.decode_calls += 1
        self.stats.tokens_computed += n
        return DecodeResult(host, out_rows, reused, n_nodes, len(set(set_index)))

    def _dev(self, a: Sequence[int] | np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a, dtype=np.int64)).to(self.model.device)

    def _eager(
        self,
        ub: UBatch,
        groups: dict[int, list[int]],
        rows_of: list[int],
        slot_mapping: np.ndarray,
        lora_scales: np.ndarray,
        plan: LoraPlan,
        use_lora: bool,
        out_rows: list[int],
    ) -> tuple[torch.Tensor, int]:
        """A prompt, mixed or side-branch ubatch through the same blocks, without a graph."""
        dev = self.model.device
        spans = [SeqSpan(seq, self._dev(rows), ub.pos[rows[0]], len(rows)) for seq, rows in groups.items()]
        seq_lens = np.asarray([ub.pos[rows[-1]] + 1 for rows in groups.values()], dtype=np.int32)
        step = StepInputs(
            token_ids=self._dev(ub.tokens),
            positions=self._dev(ub.pos),
            slot_mapping=self._dev(slot_mapping),
            lora_scales=torch.from_numpy(lora_scales).to(dev),
            query_start_loc=torch.zeros(len(groups) + 1, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(self.paged.table_rows(rows_of)).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
        )
        gctx = GpuGraphContext(
            self.model,
            step,
            self.paged,
            pool_weights=dict(self.pool.weights) if use_lora else None,
            plan=plan if use_lora else None,
            spans=spans,
            out_rows=self._dev(out_rows),
        )
        logits = self.arch.build_graph(gctx, self.model.hparams)
        self._retired.cuda_graph_eager_fallbacks += 1
        return _to_host(logits), gctx.n_nodes

    def _rollback(self, before: dict[int, int]) -> None:
        for seq, n in before.items():
            if n == 0:
                self.paged.seq_rm(seq)
            elif self.paged.seq_len(seq) > n:
                self.paged.seq_rm(seq, n)


__all__ = ["GpuGraphContext", "GpuWorkerContext", "MM_OUTPUT", "STREAM_DTYPE", "kv_dtype"]
