"""Building and running the control-plane gRPC server.

`create_server(config)` wires store → registry → worker pool → router → servicer, registers
the start-up adapters, and returns the started server with its bound port;
`run_control_plane(config)` blocks until SIGINT/SIGTERM.
"""

from __future__ import annotations

import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control_plane.auth import AdminAuthInterceptor, admin_token_from
from control_plane.base_model import default_model_path, load_base_model
from control_plane.config import ControlPlaneConfig, parse_lora_scaled
from control_plane.registry import AdapterRegistry
from control_plane.replicas import ReplicaSync
from control_plane.router import Router
from control_plane.servicer import ControlPlaneServicer
from control_plane.store import AdapterStore, open_store
from control_plane.workers import MembershipTimings, WorkerPool
from loraplane.limits import GRPC_MESSAGE_OPTIONS
from loraplane.logging import configure_logging
from loraplane.v1 import control_plane_pb2, control_plane_pb2_grpc, worker_pb2

__all__ = ["ControlPlaneConfig", "ControlPlaneState", "create_server", "parse_lora_scaled",
           "run_control_plane"]

log = structlog.get_logger("control_plane.server")

CONTROL_PLANE_SERVICE = control_plane_pb2.DESCRIPTOR.services_by_name["ControlPlane"].full_name
WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


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

    def close(self) -> None:
        """Stop the replica sync, release worker channels and the database (after the
        server stopped)."""
        self.replicas.stop()
        self.pool.close()
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
        registry = AdapterRegistry(store, base, data_dir=data_dir, adapter_dirs=config.adapter_dirs,
                                   max_upload_bytes=config.max_upload_bytes, max_lora_rank=config.max_lora_rank)
        for path, scale in config.startup_adapters:
            rec = registry.register_startup(path, scale)
            log.info("startup_adapter", adapter_id=rec.id, path=str(path), scale=scale)
        if config.lora_init_without_apply:
            registry.detach_all()
    except BaseException:
        store.close()
        raise
    timings = MembershipTimings(heartbeat_interval_s=config.heartbeat_interval_s,
                                dead_after_missed=config.dead_after_missed)
    pool = WorkerPool(registry, timings)
    replicas = ReplicaSync(store, pool, interval_s=timings.heartbeat_interval_s, dead_after_s=timings.dead_after_s)
    return ControlPlaneState(config, store, registry, pool, Router(registry, pool), health.HealthServicer(),
                             replicas)


def _bind(server: grpc.Server, config: ControlPlaneConfig) -> int:
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ValueError("TLS needs both tls_cert and tls_key")
    if config.tls_cert:
        creds = grpc.ssl_server_credentials([(Path(config.tls_key).read_bytes(),
                                              Path(config.tls_cert).read_bytes())])
        port = server.add_secure_port(config.addr, creds)
    else:
        port = server.add_insecure_port(config.addr)
    if port == 0:
        raise RuntimeError(f"cannot bind the control plane to {config.addr}")
    return port


def create_server(config: ControlPlaneConfig) -> tuple[grpc.Server, int, ControlPlaneState]:
    """A started control-plane server, its bound port, and its state.

    Serves ControlPlane plus the standard health service (SERVING) and reflection (for the
    ControlPlane, Worker and Health services). Messages up to 64 MiB both ways.
    Stop with ``server.stop(grace)`` then ``state.close()``.
    """
    configure_logging(config.log_level)
    state = build_state(config)
    token = admin_token_from(config.admin_token)
    interceptors = [AdminAuthInterceptor(token)] if token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_threads, thread_name_prefix="cp-rpc"),
        interceptors=interceptors,
        # so_reuseport 0: a second control plane on a busy port must fail to bind, not
        # silently share the port (and the clients) with the first.
        # min ping interval: clients send keepalive pings every 20 s during a call so a
        # Generate through a replica that vanished ends with UNAVAILABLE instead of hanging
        # (clients/channel.py); the server's default (5 min) would answer them with GOAWAY.
        options=[*GRPC_MESSAGE_OPTIONS, ("grpc.so_reuseport", 0),
                 ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000)],
    )
    control_plane_pb2_grpc.add_ControlPlaneServicer_to_server(
        ControlPlaneServicer(state.registry, state.pool, state.router, state.replicas), server)
    health_pb2_grpc.add_HealthServicer_to_server(state.health, server)
    reflection.enable_server_reflection(
        (CONTROL_PLANE_SERVICE, WORKER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        port = _bind(server, config)
    except BaseException:
        state.close()
        raise
    server.start()
    state.replicas.start()
    for service in ("", CONTROL_PLANE_SERVICE):
        state.health.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info("control_plane_started", addr=config.addr, port=port, database=state.store.description,
             adapters=len(state.registry.list()), admin_auth=bool(token))
    return server, port, state


def stop_server(server: grpc.Server, state: ControlPlaneState, grace_s: float = 5.0) -> None:
    """Flip health to NOT_SERVING, drain for ``grace_s``, release everything."""
    state.health.enter_graceful_shutdown()
    server.stop(grace_s).wait()
    state.close()
    log.info("control_plane_stopped")


def run_control_plane(config: ControlPlaneConfig, *, stop_event: threading.Event | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or ``stop_event``, when given, is set)."""
    stop = stop_event or threading.Event()
    server, port, state = create_server(config)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, _frame: stop.set())
    try:
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_server(server, state)
