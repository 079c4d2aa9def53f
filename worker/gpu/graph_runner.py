"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket (vLLM's
``cudagraph_capture_sizes``; SGLang's ``cuda_graph_bs``).

`GraphRunner` pads a decode step to the smallest bucket of `capture_sizes` that holds it, copies
its inputs (`StepInputs`, `HostStep`) into static device buffers sized for the largest bucket,
and replays the bucket's graph (`CapturedGraph`); padded rows write and read only the null
block. It runs the step eagerly when capture is off, for a prefill, past the largest bucket, or
when the bucket has no graph yet. `CudaGraphStats` counts captures, replays and eager fallbacks.

Buckets, padding, eager fallbacks: docs/gpu.md, "Inside the GPU engine" (CUDA graphs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

import numpy as np
import torch

from worker.gpu.paged_kv import NULL_BLOCK
from worker.gpu.sampling import SamplingRows, SamplingState, SamplingTensors
from worker.gpu.staging import Upload

Outputs = dict[str, torch.Tensor]
"""What a step's ``forward`` returns: tensors whose first dimension is the step's rows."""


def capture_sizes(max_slots: int) -> tuple[int, ...]:
    """The batch-size buckets for ``max_slots`` sequences: 1, 2, 4, 8, 16, then each power of
    two ``>= 16`` and 1.5 times it (24, 32, 48, 64, 96, …), cut at ``max_slots``, which is
    always the last bucket. Padding costs at most a third of a step's rows past 16, while a
    decode step's time barely grows with its rows (it reads the weights once).

    Raises:
        ValueError: ``max_slots < 1``.
    """
    if max_slots < 1:
        raise ValueError(f"max_slots must be >= 1, got {max_slots}")
    sizes = [1, 2, 4, 8]
    p = 16
    while p <= max_slots:
        sizes += [p, p + p // 2]
        p *= 2
    out = sorted({s for s in sizes if s < max_slots} | {max_slots})
    return tuple(out)


@dataclass
class StepInputs:
    """One step's inputs on the device (torch order; ``T`` tokens of ``S`` sequences; a decode
    step has ``T == S``).

    Attributes:
        token_ids: int64 ``(T,)``.
        positions: int64 ``(T,)``, each token's position in its sequence.
        slot_mapping: int64 ``(T,)``, where each token's K/V row is written
            (``worker.gpu.paged_kv``).
        lora_scales: f32 ``(T, max_loras)``, each token's scale on each adapter slot (0: off).
        query_start_loc: int32 ``(S + 1,)``, where each sequence's tokens start (its last entry
            is ``T``; vLLM's name).
        block_tables: int32 ``(S, max_blocks_per_seq)``.
        seq_lens: int32 ``(S,)``, positions each sequence attends to, this step's included.
        sampling: the rows' sampling parameters (``S`` rows), or None.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    lora_scales: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    sampling: SamplingTensors | None = None

    @property
    def n_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def rows(self, n: int) -> StepInputs:
        """Views of the first ``n`` rows of a decode step (one token per sequence)."""
        return StepInputs(
            token_ids=self.token_ids[:n],
            positions=self.positions[:n],
            slot_mapping=self.slot_mapping[:n],
            lora_scales=self.lora_scales[:n],
            query_start_loc=self.query_start_loc[: n + 1],
            block_tables=self.block_tables[:n],
            seq_lens=self.seq_lens[:n],
            sampling=None if self.sampling is None else self.sampling.rows(n),
        )


@dataclass
class HostStep:
    """One step's inputs as the scheduler builds them on the host: the fields of `StepInputs`
    as numpy arrays of the same dtypes and shapes, and the sampling rows (`SamplingRows`)."""

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    lora_scales: np.ndarray
    query_start_loc: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    sampling: SamplingRows | None = None

    @classmethod
    def decode(
        cls,
        *,
        token_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        lora_scales: np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        sampling: SamplingRows | None = None,
    ) -> HostStep:
        """A decode step: one token per sequence (``query_start_loc`` is ``0..B``)."""
        n = len(token_ids)
        return cls(
            token_ids,
            positions,
            slot_mapping,
            lora_scales,
            np.arange(n + 1, dtype=np.int32),
            block_tables,
            seq_lens,
            sampling,
        )

    @property
    def n_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        """One token per sequence."""
        return len(self.token_ids) == len(self.seq_lens)


@dataclass
class CudaGraphStats:
    """Counters of a `GraphRunner`.

    Attributes:
        cuda_graphs_captured: graphs captured (one per bucket at start-up).
        cuda_graph_replays: steps served by replaying a graph.
        cuda_graph_eager_fallbacks: steps run eager (capture off, a prefill, more rows than the
            largest bucket, a bucket without a graph); replays + fallbacks = steps.
    """

    cuda_graphs_captured: int = 0
    cuda_graph_replays: int = 0
    cuda_graph_eager_fallbacks: int = 0


class CapturedGraph(Protocol):
    """A recorded step: ``capture(fn)`` runs ``fn`` once while recording and returns its
    outputs (which replays overwrite in place); ``replay()`` runs the recording again."""

    def capture(self, fn: Callable[[], Outputs]) -> Outputs: ...

    def replay(self) -> None: ...


class _CudaGraph:
    """``torch.cuda.CUDAGraph`` in a memory pool shared by every bucket's graph: replays never
    overlap, so the pool serves them all (capture goes largest bucket first so the smaller
    graphs fit in what the larger one reserved)."""

    def __init__(self, pool: Any):
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool

    def capture(self, fn: Callable[[], Outputs]) -> Outputs:
        with torch.cuda.graph(self._graph, pool=self._pool):
            out = fn()
        return out

    def replay(self) -> None:
        self._graph.replay()


@dataclass
class _Field:
    """One static input: its device buffer (rows first, sized for the largest bucket), its
    host staging and its value on padded rows."""

    upload: Upload
    pad: float | int

    @property
    def host(self) -> np.ndarray:
        return self.upload.host.numpy()


class GraphRunner:
    """Runs decode steps of a model's ``forward`` through static buffers and per-bucket CUDA
    graphs (module docstring).

    ``forward(inputs: StepInputs) -> Outputs`` is the step function: any model, any kernels,
    as long as a decode step's work depends on the data only through tensors (no host syncs, no
    shapes from values), which is what capture requires. It is called with views of the static
    buffers (a decode step) or with the step's own tensors (eager). Outputs are returned cut to
    the step's rows; after a replay they are the graph's static outputs, valid until the next
    `run`.

    Args:
        forward: the step function.
        max_slots: sequences a decode step may hold (the largest bucket).
        max_loras: adapter slots (columns of ``lora_scales``).
        max_blocks_per_seq: columns of the block tables.
        device: where the static buffers live.
        capture: capture CUDA graphs (`capture_all`); False runs every step eager.
        sampling: the sampling state of the steps' rows (its scratch row pads them), or None
            when steps carry no sampling parameters.
        sizes: the buckets (default `capture_sizes` of ``max_slots``); all ``<= max_slots``.
        warmup_runs: eager runs of each bucket before its capture (lazy initializations, such
            as library workspaces and kernel autotuning, must not happen during capture).
        graph_factory: makes one `CapturedGraph` per bucket (default: a CUDA graph in a
            shared memory pool); lets the bookkeeping run without a GPU.

    Raises:
        ValueError: ``capture`` on a device that is not CUDA without a ``graph_factory``, or a
            bucket outside ``1..max_slots``.
    """

    def __init__(
        self,
        forward: Callable[[StepInputs], Outputs],
        *,
        max_slots: int,
        max_loras: int,
        max_blocks_per_seq: int,
        device: torch.device,
        capture: bool,
        sampling: SamplingState | None = None,
        sizes: tuple[int, ...] | None = None,
        warmup_runs: int = 2,
        graph_factory: Callable[[], CapturedGraph] | None = None,
    ):
        if capture and graph_factory is None and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.sizes = tuple(sorted(set(sizes if sizes is not None else capture_sizes(max_slots))))
        if not self.sizes or self.sizes[0] < 1 or self.sizes[-1] > max_slots:
            raise ValueError(f"buckets must lie in 1..{max_slots}, got {self.sizes}")
        self.forward = forward
        self.device = device
        self.capture = capture
        self.warmup_runs = warmup_runs
        self.stats = CudaGraphStats()
        self._graph_factory = graph_factory
        self._pool: Any = None
        self._graphs: dict[int, CapturedGraph] = {}
        self._outputs: dict[int, Outputs] = {}
        self._n_vocab = sampling.n_vocab if sampling is not None else 0
        rows = self.sizes[-1]
        spec: dict[str, tuple[tuple[int, ...], torch.dtype, float | int]] = {
            "token_ids": ((), torch.int64, 0),
            "positions": ((), torch.int64, 0),
            "slot_mapping": ((), torch.int64, NULL_BLOCK),  # the null block's slot 0 (block 0)
            "lora_scales": ((max_loras,), torch.float32, 0.0),
            "block_tables": ((max_blocks_per_seq,), torch.int32, NULL_BLOCK),
            "seq_lens": ((), torch.int32, 1),
        }
        self._fields: dict[str, _Field] = {}
        buffers: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            for name, (tail, dtype, pad) in spec.items():
                buffers[name] = torch.empty((rows, *tail), dtype=dtype, device=device)
                self._fields[name] = _Field(Upload(buffers[name]), pad)
            qsl = torch.arange(rows + 1, dtype=torch.int32, device=device)  # decode: one token each
            sampling_buffers = None
            if sampling is not None:
                sampling_buffers = SamplingTensors.empty(rows, sampling.n_vocab, device)
                pads = SamplingTensors.pads(sampling.scratch_row)
                for f in fields(SamplingTensors):
                    self._fields[f"sampling.{f.name}"] = _Field(Upload(getattr(sampling_buffers, f.name)), pads[f.name])
        self.static = StepInputs(**buffers, query_start_loc=qsl, sampling=sampling_buffers)
        self._pad_rows(0, rows)

    # ------------------------------------------------------------------ buckets

    def bucket_for(self, n_seqs: int) -> int | None:
        """The smallest bucket holding ``n_seqs`` rows; None beyond the largest."""
        for s in self.sizes:
            if s >= n_seqs:
                return s
        return None

    # ------------------------------------------------------------------ capture

    def capture_all(self) -> None:
        """Capture one graph per bucket, largest first, each after ``warmup_runs`` eager runs on
        padded static inputs (start-up; a no-op with capture off)."""
        if not self.capture:
            return
        rows = self.sizes[-1]
        self._pad_rows(0, rows)
        with torch.inference_mode():
            for size in reversed(self.sizes):
                view = self.static.rows(size)
                for _ in range(self.warmup_runs):
                    self.forward(view)
                graph = self._new_graph()
                self._outputs[size] = graph.capture(functools.partial(self.forward, view))
                self._graphs[size] = graph
                self.stats.cuda_graphs_captured += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _new_graph(self) -> CapturedGraph:
        if self._graph_factory is not None:
            return self._graph_factory()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return _CudaGraph(self._pool)

    # ------------------------------------------------------------------ steps

    def run(self, step: HostStep) -> Outputs:
        """Run one step: a decode step that fits a bucket goes through the static buffers and
        replays the bucket's graph (eager on them when it has none); anything else runs eager on
        its own tensors. Returns ``forward``'s outputs cut to the step's rows (a prefill's as
        ``forward`` returned them)."""
        n = step.n_seqs
        bucket = self.bucket_for(n) if step.is_decode else None
        with torch.inference_mode():
            if bucket is None:
                self.stats.cuda_graph_eager_fallbacks += 1
                return self.forward(self._fresh_inputs(step))
            self._load(step, bucket)
            graph = self._graphs.get(bucket)
            if graph is None:
                self.stats.cuda_graph_eager_fallbacks += 1
                out = self.forward(self.static.rows(bucket))
            else:
                graph.replay()
                self.stats.cuda_graph_replays += 1
                out = self._outputs[bucket]
        return {name: t[:n] for name, t in out.items()}

    def _host_values(self, step: HostStep) -> dict[str, np.ndarray | None]:
        values: dict[str, np.ndarray | None] = {name: getattr(step, name) for name in self._fields if "." not in name}
        if self.static.sampling is not None:
            if step.sampling is None:
                raise ValueError("this runner's steps carry sampling rows (sampling was given)")
            for f in fields(SamplingTensors):
                values[f"sampling.{f.name}"] = getattr(step.sampling, f.name)
        return values

    def _load(self, step: HostStep, bucket: int) -> None:
        """Stage ``step`` into the static buffers' first ``bucket`` rows (padding the rest) and
        push them: one host→device copy per field."""
        n = step.n_seqs
        for name, value in self._host_values(step).items():
            f = self._fields[name]
            f.upload.wait()
            host = f.host
            if value is None:  # grammar masks of a step without constrained rows
                host[:n] = f.pad
            else:
                host[:n] = value
            host[n:bucket] = f.pad
            f.upload.push(0, bucket)

    def _pad_rows(self, lo: int, hi: int) -> None:
        """Pad rows ``lo..hi-1`` of every static buffer."""
        for f in self._fields.values():
            f.upload.wait()
            f.host[lo:hi] = f.pad
            f.upload.push(lo, hi)

    def _fresh_inputs(self, step: HostStep) -> StepInputs:
        """``step`` copied to new device tensors (the eager path)."""

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

        sampling = None
        if self.static.sampling is not None and step.sampling is not None:
            sampling = SamplingTensors.from_rows(step.sampling, self._n_vocab, self.device)
        return StepInputs(
            token_ids=dev(step.token_ids),
            positions=dev(step.positions),
            slot_mapping=dev(step.slot_mapping),
            lora_scales=dev(step.lora_scales),
            query_start_loc=dev(step.query_start_loc),
            block_tables=dev(step.block_tables),
            seq_lens=dev(step.seq_lens),
            sampling=sampling,
        )


__all__ = ["CapturedGraph", "CudaGraphStats", "GraphRunner", "HostStep", "StepInputs", "Outputs", "capture_sizes"]
