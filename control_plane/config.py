"""Control-plane start-up options (one frozen record, filled by the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.registry import DEFAULT_MAX_UPLOAD_BYTES
from loraplane.grammar_limits import GrammarLimits
from loraplane.limits import HTTP_MAX_BODY_BYTES

RESERVED_THREADS = 16
"""Handler threads Generate relays can never take (default ``max_streams`` = threads - this)."""
ADMIN_CALLS = 4
"""Concurrent admin calls (uploads, unregisters waiting on workers, default-set writes)."""
MEMBERSHIP_CALLS = 4
"""Concurrent RegisterWorker/Heartbeat calls (each answers in milliseconds: no dialing)."""
DEFAULT_MAX_FETCHES = 4
"""Concurrent FetchAdapter streams (their own cap: a fetch storm never blocks heartbeats)."""
DEFAULT_FETCH_STALL_TIMEOUT_S = 10.0
"""A FetchAdapter reader that accepts no chunk for this long is cut off (CANCELLED)."""


def parse_lora_scaled(spec: str) -> tuple[str, float]:
    """``"PATH:SCALE"`` → ``(PATH, SCALE)`` (split at the last colon, like llama-server).

    Raises:
        ValueError: no colon or a scale that is not a number.
    """
    path, sep, scale = spec.rpartition(":")
    if not sep or not path:
        raise ValueError(f"--lora-scaled '{spec}': expected PATH:SCALE")
    try:
        return path, float(scale)
    except ValueError:
        raise ValueError(f"--lora-scaled '{spec}': scale '{scale}' is not a number") from None


@dataclass(frozen=True)
class ControlPlaneConfig:
    """Everything a control-plane process needs to start.

    Attributes:
        addr: host:port to bind ("127.0.0.1:0" picks a free port).
        data_dir: the SQLite database (when ``database`` is None) and uploaded adapter files
            live here; with PostgreSQL only uploads in progress (temporary files) do.
        database: ``sqlite:///PATH`` or ``postgresql://USER[:PASSWORD]@HOST:PORT/DB``; None
            means ``sqlite:///<data_dir>/loraplane.sqlite3``. Several replicas may share one
            PostgreSQL database (`control_plane.store`); never one SQLite file.
        db_pool_size: most PostgreSQL connections this replica opens (None: 10).
        adapter_dirs: server-side paths given to RegisterAdapter must resolve inside one of
            these (none: server paths are refused).
        model_path: base model GGUF adapters are validated against; None means the
            embedded Gemma 3 270M.
        lora: ``--lora PATH`` files, registered in order at scale 1.
        lora_scaled: ``--lora-scaled PATH:SCALE`` as ``(path, scale)``, registered after
            ``lora`` in order (a CLI that must keep the two flags interleaved can pass every
            ``--lora`` here with scale 1.0).
        lora_init_without_apply: register the start-up adapters but set every default
            scale to 0 (llama-server reports 1.0 there; we report the truth, 0).
        admin_token: bearer token for admin RPCs; None falls back to
            ``$LORAPLANE_ADMIN_TOKEN``; neither means admin RPCs are open.
        api_key: bearer key for Generate, the reads and the HTTP API (not ``/health``,
            ``/metrics``, gRPC health/reflection, worker RPCs); the admin token passes too.
            None falls back to ``$LORAPLANE_API_KEY``; neither means inference is open.
        max_upload_bytes: larger RegisterAdapter uploads get RESOURCE_EXHAUSTED.
        heartbeat_interval_s / dead_after_missed: workers heartbeat every interval and are
            dead after this many intervals without one.
        tls_cert / tls_key: PEM files; both set → the port is served with TLS.
        max_threads: gRPC handler threads (each streaming Generate holds one).
        max_streams: concurrent Generate relays; the next gets RESOURCE_EXHAUSTED at once.
            None: ``max_threads - RESERVED_THREADS`` (the reserve answers heartbeats, health,
            reads and admin calls however many streams run).
        worker_secret: shared secret workers must present on RegisterWorker/Heartbeat and
            that the control plane sends on every Worker RPC. None falls back to
            ``$LORAPLANE_WORKER_SECRET``; with neither, worker RPCs (RegisterWorker,
            Heartbeat, FetchAdapter) are refused UNAUTHENTICATED unless ``insecure_workers``.
        insecure_workers: without a worker secret, leave the worker RPCs open to anyone who
            reaches the port (a trusted network only; warned about at start). Ignored when a
            secret is configured.
        max_fetches: concurrent FetchAdapter streams; the next gets RESOURCE_EXHAUSTED (with
            pushback) at once. Its own cap, apart from membership's.
        fetch_stall_timeout_s: a FetchAdapter reader that accepts no chunk for this long, or
            stays below `control_plane.stall.MIN_RATE_BYTES_S` after a grace, is cancelled
            (its handler thread comes back).
        unload_wait_s: how long UnregisterAdapter waits for each worker to drain the adapter;
            a worker still draining then keeps it under ``draining_adapter_ids`` until freed.
        max_lora_rank: adapters with a larger rank are refused at registration
            (INVALID_ARGUMENT); the workers' ``--max-lora-rank``.
        log_level: structlog level ("debug", "info", ...).
        http_addr: host:port of the OpenAI-compatible HTTP front (None: off; port 0 picks one).
        client_write_timeout_s: seconds a response write (an HTTP response, a gRPC ``Generate``
            event) may wait on a client that reads nothing; past it the client counts as gone
            and its generation is cancelled.
        http_max_connections: open HTTP connections; past it a new one is reset at once.
        http_max_connections_per_client: open HTTP connections per client address; past it a
            new one from that address is reset at once (0: no limit).
        http_head_timeout_s: seconds an HTTP connection may stay open without a complete
            request head (from its opening or its last response).
        http_head_timeout_busy_s: the same once the open connections reach 3/4 of
            ``http_max_connections`` (connections already open included).
        metrics_addr: host:port of the listener for ``/health`` and the Prometheus ``/metrics``
            (None: off; the HTTP front serves both too, within its own connection cap).
        chat_template: jinja2 chat template file overriding the model's (None: the GGUF's
            ``tokenizer.chat_template``, else a built-in one for the architecture).
        served_model_name: the base model's name on the HTTP API (None: the GGUF file's stem).
        metrics_max_adapters: distinct adapter label values in metrics before "other".
        http_max_body_bytes: larger HTTP request bodies get 413 before they are read.
        http_max_prompt_bytes: a completions text prompt or a chat conversation's content over
            this many UTF-8 bytes gets 400 before any template or tokenizer runs. None: the
            gRPC path's rule, ``(n_ctx - 1) × longest vocab piece`` with ``n_ctx`` =
            ``http_n_ctx`` (`control_plane.http.deps.prompt_byte_limit`).
        http_n_ctx: the context (tokens) the HTTP front sizes prompts for: prompts of this many
            tokens or more get 400 before routing. ``serve`` passes its worker's ``--n-ctx``;
            None: the model's training context (``<arch>.context_length``).

        grammar_limits: bounds on every request's structured-output format and tools
            (``--grammar-max-*``, ``--max-tools``; `loraplane.grammar_limits`).
        grammar_check_processes / grammar_check_timeout_s: the child processes formats are
            compiled in, and how long one may take (`control_plane.grammar_check`).

    Start-up flags set the default scale of the adapters they name, every start; adapters
    they do not name keep their persisted scale.
    """

    addr: str = "127.0.0.1:50051"
    data_dir: str = "data"
    database: str | None = None
    db_pool_size: int | None = None
    adapter_dirs: tuple[str, ...] = ()
    model_path: str | None = None
    lora: tuple[str, ...] = ()
    lora_scaled: tuple[tuple[str, float], ...] = ()
    lora_init_without_apply: bool = False
    admin_token: str | None = None
    api_key: str | None = None
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    heartbeat_interval_s: float = 1.0
    dead_after_missed: int = 3
    tls_cert: str | None = None
    tls_key: str | None = None
    max_threads: int = 64
    max_streams: int | None = None
    worker_secret: str | None = None
    insecure_workers: bool = False
    max_fetches: int = DEFAULT_MAX_FETCHES
    fetch_stall_timeout_s: float = DEFAULT_FETCH_STALL_TIMEOUT_S
    unload_wait_s: float = 5.0
    max_lora_rank: int = 64
    log_level: str = "info"
    http_addr: str | None = None
    client_write_timeout_s: float = 30.0
    http_max_connections: int = 1024
    http_max_connections_per_client: int = 256
    http_head_timeout_s: float = 30.0
    http_head_timeout_busy_s: float = 2.0
    metrics_addr: str | None = None
    chat_template: str | None = None
    served_model_name: str | None = None
    metrics_max_adapters: int = 64
    http_max_body_bytes: int = HTTP_MAX_BODY_BYTES
    http_max_prompt_bytes: int | None = None
    http_n_ctx: int | None = None
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    grammar_check_processes: int = 2
    grammar_check_timeout_s: float = 10.0

    @property
    def stream_limit(self) -> int:
        """Concurrent Generate relays allowed (see ``max_streams``).

        Raises:
            ValueError: the limits leave no thread for the reserved calls, or ``max_fetches`` < 1.
        """
        limit = self.max_streams if self.max_streams is not None else self.max_threads - RESERVED_THREADS
        if self.max_fetches < 1:
            raise ValueError(f"max_fetches must be at least 1, got {self.max_fetches}")
        reserved = ADMIN_CALLS + MEMBERSHIP_CALLS + self.max_fetches
        if limit < 1 or limit + reserved >= self.max_threads:
            raise ValueError(
                f"max_threads {self.max_threads} must exceed max_streams {limit} + "
                f"{reserved} (admin + membership + max_fetches) so reads and health "
                f"keep a thread"
            )
        return limit

    @property
    def startup_adapters(self) -> list[tuple[str, float]]:
        """``(path, scale)`` in registration order: every ``lora`` (scale 1), then ``lora_scaled``."""
        return [(p, 1.0) for p in self.lora] + [(p, float(s)) for p, s in self.lora_scaled]
