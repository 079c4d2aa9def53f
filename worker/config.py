"""Worker start-up options (one frozen record, filled by the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from loraplane.grammar_limits import GrammarLimits


class Batching(str, Enum):
    """How KV sequences with different adapter sets share a ubatch.

    ``compat``: llama-server's rule (``server-context``): only sequences whose whole adapter
    set is equal batch together. ``mixed``: vLLM/S-LoRA style, any sequences share a ubatch and
    the low-rank branches are computed per segment.
    """

    MIXED = "mixed"
    COMPAT = "compat"


class PrefixCachePolicy(str, Enum):
    """``llama``: one cached prompt per KV sequence, cleared by llama.cpp's ``lora_should_clear_cache``
    rule. ``keyed``: cached prefixes keyed by adapter-set fingerprint, so each set keeps its own.
    """

    KEYED = "keyed"
    LLAMA = "llama"


class Fairness(str, Enum):
    """Admission order across tenants. ``off``: first come, first served within the slot
    pool's resident-first rule (``worker.serving.admission``). ``vtc``: the Virtual
    Token Counter across the requests' tenants, weighted, with priority classes
    (``worker.serving.fairness``)."""

    OFF = "off"
    VTC = "vtc"


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process needs to start.

    Attributes:
        addr: host:port to bind ("127.0.0.1:0" picks a free port).
        model_path: base model GGUF; None means the embedded Gemma 3 270M.
        n_seqs: parallel KV sequences (``--slots``, llama-server's ``--parallel``: its server
            slots; "slot" alone means an adapter slot here).
        batching / prefix_cache: see the enums.
        dtype: compute (activation) dtype, "f32", "bf16" or "f16"
            (``worker.runtime.device.DTYPES``; on CPU f32 is the C kernels' exact path).
        kv_cache_dtype: the CPU KV cache's storage, "auto" (f16 under f32 compute with packed
            weights: llama.cpp's default), "f32", "f16" or "bf16" (``--kv-cache-dtype``;
            ``worker.runtime.kv_cache.kv_cache_dtype``); the GPU engine takes only "auto".
        weight_form: "packed" (GGUF-quantized matrices, our kernels) or "dequant" (reference).
        device: "auto" (the current CUDA device when present, else CPU), "cpu" / "cpu:0",
            "cuda" (the current CUDA device) or "cuda:N" (``loraplane.compute_spec``); resolved
            once when the model loads, which refuses a GPU that is not there.
        n_ctx_seq: tokens of KV per sequence (``--n-ctx``; llama.cpp's ``n_ctx_seq``).
        queue_limit: requests waiting beyond the sequences before RESOURCE_EXHAUSTED.
        control_plane: host:port of the control plane to register with (None: standalone).
        advertise_addr: address the control plane should dial (defaults to the bound one).
        worker_id: stable name; generated when empty.
        prefix_cache_tokens: token budget of the keyed prefix cache (LRU beyond it).
        log_level: structlog level of the worker process ("debug" logs every decode step).
        metrics_addr: host:port of the Prometheus ``/metrics`` endpoint (None: not served;
            port 0 picks a free one).
        metrics_max_adapters: distinct adapter label values in metrics before the rest are
            folded into "other" (``loraplane.metrics.BoundedLabels``).
        adapter_dirs: ``LoadAdapter(server_path)`` may only name files inside these
            (resolved, checked before anything is read; none: server paths are refused and
            adapters arrive as bytes, which is what the control plane sends).
        worker_secret: shared secret every Worker RPC must carry and that membership calls
            send (None: ``$LORAPLANE_WORKER_SECRET``; neither: no check, as before).
        extra_streams: Decode streams accepted beyond ``n_seqs + queue_limit`` (streams
            whose request already finished but which are still closing); beyond that a new
            stream gets RESOURCE_EXHAUSTED at once.
        max_loras: adapter slots in the device pool (vLLM ``--max-loras``); a request may use
            at most this many adapters.
        max_cpu_loras: adapters kept validated on the host, ready to page in (vLLM
            ``--max-cpu-loras``), LRU beyond it; never fewer than ``max_loras`` (resident
            adapters stay on host too). File-backed: the worker keeps each one's tensor index
            and re-reads the tensors from its local file at page-in (``open_lora_adapter``).
        max_lora_rank: largest rank an adapter may have here (vLLM ``--max-lora-rank``).
        drain_timeout_s: on SIGTERM, seconds in-flight generations may take to finish while
            nothing new is admitted (``--drain-timeout``; + the stop grace of 5 s below the
            Kubernetes ``terminationGracePeriodSeconds`` of 60 in ``deploy/k8s/workers.yaml``).
        fairness: admission order across tenants (``Fairness``; ``--fairness``).
        fairness_prompt_weight / fairness_output_weight: VTC's virtual tokens per prompt
            token / per generated token (``--fairness-prompt-weight`` 1,
            ``--fairness-output-weight`` 2: the paper's evaluation); finite and > 0, checked
            when the scheduler is made (ValueError).
        grammar_limits: bounds on a request's structured-output format, checked before the
            grammar engine sees it (``--grammar-max-*``; the control plane holds every request to
            the same bounds first: `loraplane.grammar_limits`).
        grammar_warmup: build the grammar engine's view of the vocabulary at start-up, before
            registering (``--no-grammar-warmup``: at the first constrained request instead;
            `worker.runtime.grammar.grammar_tokenizer`).
    """

    addr: str = "127.0.0.1:0"
    model_path: str | None = None
    n_seqs: int = 4
    batching: Batching = Batching.MIXED
    prefix_cache: PrefixCachePolicy = PrefixCachePolicy.KEYED
    dtype: str = "f32"
    kv_cache_dtype: str = "auto"
    weight_form: str = "packed"
    device: str = "auto"
    n_ctx_seq: int = 4096
    queue_limit: int = 64
    control_plane: str | None = None
    advertise_addr: str | None = None
    worker_id: str = ""
    prefix_cache_tokens: int = 65536
    log_level: str = "info"
    metrics_addr: str | None = None
    metrics_max_adapters: int = 64
    adapter_dirs: tuple[str, ...] = ()
    worker_secret: str | None = None
    extra_streams: int = 4

    @property
    def max_decode_streams(self) -> int:
        """Concurrent Decode streams accepted: every sequence, every queue place, and a margin."""
        return self.n_seqs + self.queue_limit + self.extra_streams

    max_loras: int = 16
    max_cpu_loras: int = 128
    max_lora_rank: int = 64
    drain_timeout_s: float = 45.0
    fairness: Fairness = Fairness.OFF
    fairness_prompt_weight: float = 1.0
    fairness_output_weight: float = 2.0
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    grammar_warmup: bool = True
