"""Building and running the control-plane gRPC server.

`create_server(config)` wires store → registry → worker pool → router → servicer, registers
the start-up adapters, and returns the started server with its bound port;
`run_control_plane(config)` blocks until SIGINT/SIGTERM.

Threads: one ``ThreadPoolExecutor`` of ``max_threads``; a streaming Generate relay holds a
thread for its whole life, so groups of calls are capped (`ConcurrencyLimitInterceptor`,
RESOURCE_EXHAUSTED at once beyond the cap) and the rest of the pool stays free for short
calls: Generate ≤ ``stream_limit`` (default ``max_threads - 16``), admin calls ≤ 4,
RegisterWorker/Heartbeat ≤ 4 (both answer in milliseconds: dialing a worker happens in the
pool's own join threads), FetchAdapter ≤ ``max_fetches`` (default 4; its own cap, so a fetch
storm never blocks heartbeats; a reader that stalls is cancelled after
``fetch_stall_timeout_s``, `control_plane.stall`). Reads, health and reflection are never
capped and always find a thread. Interceptors, outermost first: status details bounded
(`loraplane.status_details`: no message outgrows a client's metadata limit), the inference API
key (every ControlPlane call; the admin token passes too), admin token, the worker door
(`loraplane.worker_secret.worker_door`: the secret's guard; without a secret the worker RPCs
are refused UNAUTHENTICATED unless ``insecure_workers``), decode guard (undecodable requests →
INVALID_ARGUMENT), the caps.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from control_plane.adapter_labels import AdapterNaming, adapter_label
from control_plane.auth import (
    ADMIN_METHODS,
    AdminAuthInterceptor,
    ApiKeyInterceptor,
    admin_token_from,
    api_key_from,
)
from control_plane.base_model import default_model_path, load_base_model
from control_plane.config import ADMIN_CALLS, MEMBERSHIP_CALLS, ControlPlaneConfig, parse_lora_scaled
from control_plane.errors import DatabaseUnavailableError
from control_plane.grammar_check import GrammarChecker
from control_plane.http.models import served_name
from control_plane.membership import WorkerPool
from control_plane.metrics import ControlPlaneMetrics
from control_plane.names import served_base_name
from control_plane.quotas import QuotaBook
from control_plane.registry import AdapterRegistry
from control_plane.replicas import ReplicaSync
from control_plane.router import Router
from control_plane.servicer import ControlPlaneServicer, WorkerMembershipServicer
from control_plane.stall import StallWatchdog
from control_plane.store import AdapterStore, open_store
from control_plane.tenant_admin import TenantAdmin
from control_plane.tenants import TenantDirectory
from control_plane.workers import MembershipTimings
from loraplane.interceptors import ConcurrencyLimitInterceptor, DecodeGuardInterceptor
from loraplane.limits import GRPC_MESSAGE_OPTIONS
from loraplane.logging import configure_logging
from loraplane.reflection import enable_reflection
from loraplane.status_details import BoundedStatusInterceptor
from loraplane.v1 import control_plane_pb2, control_plane_pb2_grpc, membership_pb2, membership_pb2_grpc
from loraplane.worker_secret import (
    FETCH_METHODS,
    MEMBERSHIP_METHODS,
    NO_SECRET_HINT,
    worker_door,
    worker_secret_from,
)

__all__ = ["ControlPlaneConfig", "ControlPlaneState", "create_server", "parse_lora_scaled", "run_control_plane"]

log = structlog.get_logger("loraplane.control_plane.server")

CONTROL_PLANE_SERVICE = control_plane_pb2.DESCRIPTOR.services_by_name["ControlPlane"].full_name
GENERATE_METHOD = f"/{CONTROL_PLANE_SERVICE}/Generate"
MEMBERSHIP_SERVICE = membership_pb2.DESCRIPTOR.services_by_name["WorkerMembership"].full_name
METRICS_MAX_CONNECTIONS = 64
"""Open connections of the ``--metrics-addr`` listener: probes and scrapers, a handful each."""
METRICS_MAX_CONNECTIONS_PER_CLIENT = 16
"""Open connections of the ``--metrics-addr`` listener per client address: one address that
keeps reopening idle connections cannot hold all `METRICS_MAX_CONNECTIONS` (and the load
balancer's health checks out) however fast the head deadline sheds them."""


@dataclass
class ControlPlaneState:
    """The live objects behind a control-plane server (tests and `serve` reach in here)."""

    config: ControlPlaneConfig
    store: AdapterStore
    registry: AdapterRegistry
    pool: WorkerPool
    router: Router
    health: health.HealthServicer
    replicas: ReplicaSync
    metrics: ControlPlaneMetrics | None = None
    quotas: QuotaBook | None = None  # tenant quotas, synced with the store (started with the server)
    tenant_admin: TenantAdmin | None = None
    http: Any = None  # control_plane.http.server.HttpServer when --http-addr is set
    http_port: int = 0
    metrics_server: Any = None  # the /health + /metrics HttpServer when --metrics-addr is set
    metrics_port: int = 0
    fetch_watchdog: StallWatchdog | None = None  # cuts off stalled FetchAdapter readers

    def close(self) -> None:
        """Stop the HTTP and metrics servers and the replica sync, release worker channels and
        the database (after the gRPC server stopped)."""
        if self.http is not None:
            self.http.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.quotas is not None:
            self.quotas.stop()
        self.replicas.stop()
        self.pool.close()
        self.router.grammar.close()
        self.store.close()


def build_state(config: ControlPlaneConfig) -> ControlPlaneState:
    """Open the data dir, index the base model and register the start-up adapters.

    Raises:
        GGUFError: the base model cannot be read; ControlPlaneError: a start-up adapter is
        missing or invalid (the server refuses to start).
    """
    data_dir = Path(config.data_dir)
    store = open_store(config.database, data_dir, pool_size=config.db_pool_size)
    try:
        base = load_base_model(config.model_path or default_model_path())
        registry = AdapterRegistry(
            store,
            base,
            data_dir=data_dir,
            adapter_dirs=config.adapter_dirs,
            max_upload_bytes=config.max_upload_bytes,
            max_lora_rank=config.max_lora_rank,
            base_name=served_base_name(config.served_model_name, base.path),
        )
        for path, scale in config.startup_adapters:
            rec = registry.register_startup(path, scale)
            log.info("startup_adapter", adapter_id=rec.id, path=str(path), scale=scale)
        if config.lora_init_without_apply:
            registry.detach_all()
    except BaseException:
        store.close()
        raise
    timings = MembershipTimings(
        heartbeat_interval_s=config.heartbeat_interval_s,
        dead_after_missed=config.dead_after_missed,
        unload_wait_s=config.unload_wait_s,
    )
    pool = WorkerPool(registry, timings, secret=worker_secret_from(config.worker_secret))
    replicas = ReplicaSync(store, pool, interval_s=timings.heartbeat_interval_s, dead_after_s=timings.dead_after_s)
    directory = TenantDirectory(api_key=api_key_from(config.api_key), admin_token=admin_token_from(config.admin_token))
    metrics = build_metrics(config, registry, pool)
    quotas = QuotaBook(store, directory, metrics=metrics)
    metrics.quotas = quotas
    grammar = GrammarChecker(
        config.grammar_limits, processes=config.grammar_check_processes, timeout_s=config.grammar_check_timeout_s
    )
    router = Router(registry, pool, tenants=directory, quotas=quotas, grammar=grammar)
    router.observer = metrics
    return ControlPlaneState(
        config,
        store,
        registry,
        pool,
        router,
        health.HealthServicer(),
        replicas,
        metrics,
        quotas=quotas,
        tenant_admin=TenantAdmin(store, quotas),
    )


def build_metrics(config: ControlPlaneConfig, registry: AdapterRegistry, pool: WorkerPool) -> ControlPlaneMetrics:
    """The control plane's Prometheus metrics over the live registry and pool."""

    # Metrics never fail for a database outage: names fall back to ``adapter:<id>`` and the
    # adapter count to the last one read.
    base_name = registry.names.base_name

    def adapters() -> dict[int, AdapterNaming] | None:
        try:
            records = registry.list()
        except DatabaseUnavailableError:
            return None
        out = {}
        for rec in records:
            served = served_name(rec, records, base_name)
            out[rec.id] = AdapterNaming(served, adapter_label(rec.id, rec.name, served))
        return out

    def pool_state() -> tuple[int, int, int]:
        live = pool.live()
        # a worker that has not reported its pool (older worker, another replica's sighting)
        # counts its slots: without a pool each slot could run another adapter set
        max_lora = sum(w.paging.max_loras or w.n_slots for w in live)
        return len(live), sum(w.n_slots for w in live), max_lora

    metrics = ControlPlaneMetrics(
        model_name=base_name or "",
        adapters=adapters,
        pool_state=pool_state,
        adapter_label_cap=config.metrics_max_adapters,
        holdings=pool.holdings,
    )
    pool.on_paging = metrics.on_paging
    return metrics


def start_side_servers(state: ControlPlaneState) -> None:
    """The metrics listener (``metrics_addr``: ``/health`` and ``/metrics``, its own connections)
    and the HTTP front (``http_addr``), when set; their connection counts go to the metrics.

    Raises:
        OSError: an address cannot be bound; RuntimeError: uvicorn did not start.
    """
    from control_plane.http.connections import ConnectionCollector, ConnectionGuard
    from control_plane.http.server import HttpServer

    config = state.config
    guards: list[ConnectionGuard] = []
    if state.metrics is not None:
        state.metrics.registry.register(ConnectionCollector(guards))
    if config.metrics_addr and state.metrics is not None:
        from control_plane.http.health import health_app

        state.metrics_server = HttpServer(
            health_app(state.metrics.exposition),
            config.metrics_addr,
            listener="metrics",
            max_connections=METRICS_MAX_CONNECTIONS,
            max_connections_per_client=METRICS_MAX_CONNECTIONS_PER_CLIENT,
            head_timeout_s=config.http_head_timeout_s,
            head_timeout_busy_s=config.http_head_timeout_busy_s,
        )
        guards.append(state.metrics_server.guard)
        state.metrics_port = state.metrics_server.start()
        log.info("metrics_serving", addr=config.metrics_addr, port=state.metrics_port)
    if config.http_addr:
        from control_plane.http.app import create_app

        state.http = HttpServer(
            create_app(http_deps(state)),
            config.http_addr,
            max_connections=config.http_max_connections,
            max_connections_per_client=config.http_max_connections_per_client,
            head_timeout_s=config.http_head_timeout_s,
            head_timeout_busy_s=config.http_head_timeout_busy_s,
        )
        guards.append(state.http.guard)
        state.http_port = state.http.start()
        log.info("http_serving", addr=config.http_addr, port=state.http_port)


def http_deps(state: ControlPlaneState) -> Any:
    """The HTTP front's dependencies: this process's registry, router and pool."""
    from control_plane.http.app import HttpDeps
    from control_plane.http.chat_template import load_chat_template
    from control_plane.http.deps import max_piece_bytes, n_ctx_train, prompt_byte_limit

    base = state.registry.base
    tok = base.tokenizer()
    template = None
    if tok is not None or state.config.chat_template:

        def special(token_id: int) -> str:
            return tok.token_to_piece(token_id) if tok is not None and token_id >= 0 else ""

        template = load_chat_template(
            override_file=state.config.chat_template,
            metadata=base.gguf.metadata,
            arch=base.arch,
            bos_token=special(getattr(tok, "bos_id", -1)),
            eos_token=special(getattr(tok, "eos_id", -1)),
        )
    n_ctx = state.config.http_n_ctx or n_ctx_train(base.gguf.metadata, base.arch)
    max_prompt_bytes = state.config.http_max_prompt_bytes
    max_piece = None  # the limit follows the live workers' n_ctx unless the operator fixed it
    if max_prompt_bytes is None and tok is not None:
        max_piece = max_piece_bytes(tok)
        max_prompt_bytes = prompt_byte_limit(tok, n_ctx)
    return HttpDeps(
        registry=state.registry,
        router=state.router,
        announcer=state.pool.adapters,
        base_name=served_base_name(state.config.served_model_name, base.path),
        base_root=str(base.path),
        tokenizer=tok,
        chat_template=template,
        admin_token=admin_token_from(state.config.admin_token),
        api_key=api_key_from(state.config.api_key),
        metrics_text=state.metrics.exposition if state.metrics is not None else None,
        write_timeout_s=state.config.client_write_timeout_s,
        max_body_bytes=state.config.http_max_body_bytes,
        max_prompt_bytes=max_prompt_bytes,
        n_ctx=n_ctx,
        live_n_ctx=state.pool.max_n_ctx,
        max_piece=max_piece,
        tenants=state.router.tenants,
        tenant_admin=state.tenant_admin,
    )


def _bind(server: grpc.Server, config: ControlPlaneConfig) -> int:
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ValueError("TLS needs both tls_cert and tls_key")
    if config.tls_cert and config.tls_key:
        creds = grpc.ssl_server_credentials([(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())])
        port = server.add_secure_port(config.addr, creds)
    else:
        port = server.add_insecure_port(config.addr)
    if port == 0:
        raise RuntimeError(f"cannot bind the control plane to {config.addr}")
    return port


def create_server(config: ControlPlaneConfig) -> tuple[grpc.Server, int, ControlPlaneState]:
    """A started control-plane server, its bound port, and its state.

    Serves ControlPlane plus the standard health service (SERVING) and reflection (for the
    ControlPlane and Health services: it does not serve Worker). Messages up to 64 MiB both
    ways. Stop with ``server.stop(grace)`` then ``state.close()``.

    Raises:
        ValueError: thread limits that leave nothing for reads (`ControlPlaneConfig.stream_limit`),
            a fetch stall or client write timeout ≤ 0.
    """
    configure_logging(config.log_level)
    stream_limit = config.stream_limit
    fetch_watchdog = StallWatchdog(config.fetch_stall_timeout_s)  # validates before anything opens
    generate_watchdog = StallWatchdog(config.client_write_timeout_s, min_rate_bytes_s=0, kind="generate")
    state = build_state(config)
    token = admin_token_from(config.admin_token)
    api_key = api_key_from(config.api_key)
    secret = worker_secret_from(config.worker_secret)
    limits = ConcurrencyLimitInterceptor(
        {
            "Generate stream": (stream_limit, GENERATE_METHOD.__eq__),
            "admin": (ADMIN_CALLS, ADMIN_METHODS.__contains__),
            "worker membership": (MEMBERSHIP_CALLS, MEMBERSHIP_METHODS.__contains__),
            "adapter fetch": (config.max_fetches, FETCH_METHODS.__contains__),
        },
        hint=" (control plane: --max-streams / --max-threads / --max-fetches)",
    )
    interceptors = [
        BoundedStatusInterceptor(),
        *([ApiKeyInterceptor(api_key, token, state.router.tenants.accepts)] if api_key else []),
        *([AdminAuthInterceptor(token)] if token else []),
        *worker_door(secret, config.insecure_workers),
        DecodeGuardInterceptor(),
        limits,
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_threads, thread_name_prefix="cp-rpc"),
        interceptors=interceptors,
        # so_reuseport 0: a second control plane on a busy port must fail to bind, not
        # silently share the port (and the clients) with the first.
        # min ping interval: clients send keepalive pings every 20 s during a call so a
        # Generate through a replica that vanished ends with UNAVAILABLE instead of hanging
        # (clients/channel.py); the server's default (5 min) would answer them with GOAWAY.
        options=[
            *GRPC_MESSAGE_OPTIONS,
            ("grpc.so_reuseport", 0),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ],
    )
    state.fetch_watchdog = fetch_watchdog
    control_plane_pb2_grpc.add_ControlPlaneServicer_to_server(
        ControlPlaneServicer(
            state.registry,
            state.pool,
            state.router,
            state.replicas,
            generate_watchdog=generate_watchdog,
            tenants=state.tenant_admin,
        ),
        server,
    )
    membership_pb2_grpc.add_WorkerMembershipServicer_to_server(
        WorkerMembershipServicer(state.registry, state.pool, state.replicas, fetch_watchdog=state.fetch_watchdog),
        server,
    )
    health_pb2_grpc.add_HealthServicer_to_server(state.health, server)
    enable_reflection((CONTROL_PLANE_SERVICE, MEMBERSHIP_SERVICE, health.SERVICE_NAME), server)
    try:
        port = _bind(server, config)
        start_side_servers(state)
    except BaseException:
        server.stop(0)
        state.close()
        raise
    if state.quotas is not None:
        state.quotas.start()  # keys and limits loaded before the first request is served
    server.start()
    state.replicas.start()
    for service in ("", CONTROL_PLANE_SERVICE, MEMBERSHIP_SERVICE):
        state.health.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "control_plane_started",
        addr=config.addr,
        port=port,
        database=state.store.description,
        adapters=len(state.registry.list()),
        admin_auth=bool(token),
        worker_secret=bool(secret),
        insecure_workers=not secret and config.insecure_workers,
        max_threads=config.max_threads,
        stream_limit=stream_limit,
        http_port=state.http_port or None,
        metrics_port=state.metrics_port or None,
    )
    log_worker_door(config, secret)
    return server, port, state


def log_worker_door(config: ControlPlaneConfig, secret: str | None) -> None:
    """Say at start-up, loudly, when the worker RPCs are closed or open to anyone."""
    if secret:
        if config.insecure_workers:
            log.warning("insecure_workers_ignored", reason="a worker secret is configured; workers must present it")
        return
    if config.insecure_workers:
        log.warning(
            "insecure_workers",
            warning="--insecure-workers: RegisterWorker, Heartbeat and FetchAdapter are open to anyone who "
            "reaches this port (any caller can join as a worker or download any adapter's bytes); "
            "use only on a trusted network, or set --worker-secret",
        )
        return
    log.warning(
        "workers_cannot_join",
        reason=f"no worker secret: RegisterWorker, Heartbeat and FetchAdapter are refused; {NO_SECRET_HINT}",
    )


def stop_server(server: grpc.Server, state: ControlPlaneState, grace_s: float = 5.0) -> None:
    """Flip health to NOT_SERVING, drain for ``grace_s``, release everything."""
    state.health.enter_graceful_shutdown()
    server.stop(grace_s).wait()
    state.close()
    log.info("control_plane_stopped")


def run_control_plane(
    config: ControlPlaneConfig,
    *,
    stop_event: threading.Event | None = None,
    before_stop: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (or ``stop_event``, when given, is set).

    ``before_stop`` (``loraplane serve``: drain its worker) runs on this thread once stopping
    was asked for, while everything still serves, so streams relayed from a draining worker
    run to their end; a signal during it is that hook's business (its own handlers)."""
    stop = stop_event or threading.Event()
    server, port, state = create_server(config)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, _frame: stop.set())
    try:
        stop.wait()
        if before_stop is not None:
            before_stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_server(server, state)
