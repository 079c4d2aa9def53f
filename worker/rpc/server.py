"""Worker process: gRPC server with the Worker service, standard health and reflection.

``create_server`` binds (port 0 picks a free one), loads the model, and flips health to
SERVING once the model is ready; ``serve_worker`` also registers with the control plane and
blocks until SIGINT/SIGTERM, then reports NOT_SERVING and stops.

Threads (one ``ThreadPoolExecutor``; a streaming call holds a thread for its whole life):

- ``Decode`` streams: at most ``config.max_decode_streams`` (slots + queue limit + a margin)
  at once; the next one gets RESOURCE_EXHAUSTED immediately (`ConcurrencyLimitInterceptor`),
  so no request ever waits invisibly inside gRPC for a thread;
- ``LoadAdapter`` / ``UnloadAdapter`` (long: reading chunks, draining): at most
  `ADAPTER_OPS` at once;
- `RESERVED_THREADS` more threads that only short calls can use: ``Stats``,
  ``ListAdapters``, health checks and reflection answer within milliseconds under any load.

Interceptors, outermost first: the worker secret (when configured; every Worker RPC, not
health/reflection), undecodable requests → INVALID_ARGUMENT, the limits above.
"""

from __future__ import annotations

import signal
import threading
import uuid
from concurrent import futures

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraplane.interceptors import ConcurrencyLimitInterceptor, DecodeGuardInterceptor
from loraplane.limits import GRPC_MESSAGE_OPTIONS
from loraplane.v1 import control_plane_pb2, worker_pb2, worker_pb2_grpc
from loraplane.worker_secret import worker_guard, worker_secret_from
from worker.config import WorkerConfig
from worker.rpc.servicer import WorkerServicer
from worker.serving.engine import WorkerEngine

log = structlog.get_logger("loraplane.worker.rpc.server")

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
ADAPTER_OPS = 2
"""Concurrent LoadAdapter/UnloadAdapter calls (the control plane announces one at a time per worker)."""
RESERVED_THREADS = 8
"""Pool threads beyond the streaming/adapter limits, left for Stats, ListAdapters, health."""


def server_interceptors(config: WorkerConfig) -> list[grpc.ServerInterceptor]:
    """Worker secret (if any), decode guard, concurrency limits — in that order."""
    limits = ConcurrencyLimitInterceptor(
        {
            "Decode stream": (config.max_decode_streams, f"/{SERVICE_NAME}/Decode".__eq__),
            "adapter load/unload": (
                ADAPTER_OPS,
                lambda m: m in (f"/{SERVICE_NAME}/LoadAdapter", f"/{SERVICE_NAME}/UnloadAdapter"),
            ),
        },
        hint=" (worker: slots + --queue-limit)",
    )
    secret = worker_secret_from(config.worker_secret)
    guards = [worker_guard(secret)] if secret else []
    return [*guards, DecodeGuardInterceptor(), limits]


def create_server(config: WorkerConfig) -> tuple[grpc.Server, int, WorkerEngine]:
    """Load the model, start the scheduler, bind and start the gRPC server.

    Returns:
        (server, bound port, engine).

    Raises:
        worker.runtime.model.ModelError / GGUFError: the base model cannot be loaded.
        RuntimeError: the address cannot be bound.
    """
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    engine = WorkerEngine(config)
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=config.max_decode_streams + ADAPTER_OPS + RESERVED_THREADS, thread_name_prefix="worker-rpc"
        ),
        interceptors=server_interceptors(config),
        options=GRPC_MESSAGE_OPTIONS,
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(engine), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(config.addr)
    if port == 0:
        engine.close()
        raise RuntimeError(f"cannot bind worker address {config.addr}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    server.health_servicer = health_servicer  # kept for shutdown
    log.info(
        "worker_serving",
        addr=config.addr,
        port=port,
        worker_id=engine.worker_id,
        model=str(engine.base.path),
        device=str(engine.base.device),
        dtype=config.dtype,
        batching=config.batching.value,
        prefix_cache=config.prefix_cache.value,
        worker_secret=bool(worker_secret_from(config.worker_secret)),
        adapter_dirs=list(config.adapter_dirs),
        max_decode_streams=config.max_decode_streams,
    )
    return server, port, engine


def holdings_of(engine: WorkerEngine) -> control_plane_pb2.WorkerHoldings:
    """What this worker holds, for heartbeats: usable adapters (id, sha256: every id it
    knows, whether its bytes are fetched yet or not) and draining ids."""
    draining = engine.draining_ids()
    return control_plane_pb2.WorkerHoldings(
        adapters=[
            control_plane_pb2.HeldAdapter(id=i, sha256=k.sha256)
            for i, k in sorted(engine.known().items())
            if i not in draining
        ],
        draining_ids=sorted(draining),
    )


def refresh_hello(engine: WorkerEngine, hello: control_plane_pb2.WorkerHello) -> None:
    """Write what ``engine`` holds now (resident / host adapter ids, paging counters) into
    ``hello`` — sent with every heartbeat so any control plane can route by affinity."""
    st = engine.stats()
    del hello.resident_adapter_ids[:]
    hello.resident_adapter_ids.extend(st.resident_adapter_ids)
    del hello.host_adapter_ids[:]
    hello.host_adapter_ids.extend(st.host_adapter_ids)
    hello.paging.CopyFrom(
        control_plane_pb2.WorkerPaging(
            max_loras=st.max_loras,
            max_cpu_loras=st.max_cpu_loras,
            resident=st.resident_adapters,
            host=st.host_adapters,
            page_ins=st.page_ins,
            evictions=st.evictions,
            fetches=st.fetches,
            fetch_bytes=st.fetch_bytes,
            page_in_bytes=st.page_in_bytes,
            host_evictions=st.host_evictions,
        )
    )


def _advertised(config: WorkerConfig, port: int) -> str:
    if config.advertise_addr:
        return config.advertise_addr
    host = config.addr.rsplit(":", 1)[0] or "127.0.0.1"
    if host in ("0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


def serve_worker(config: WorkerConfig) -> None:
    """Run a worker until SIGINT/SIGTERM; registers with ``config.control_plane`` when set."""
    from loraplane.logging import configure_logging  # one JSON log format for both planes

    configure_logging(config.log_level)
    from loraplane.progress import progress_enabled, spinner
    from worker.serving.heap import limit_arenas

    limit_arenas()  # before the gRPC and OpenMP threads exist (worker.serving.heap)

    with spinner("loading the model", enabled=progress_enabled()):
        server, port, engine = create_server(config)
    stop = threading.Event()
    metrics_server = None
    if config.metrics_addr:
        from loraplane.metrics import start_metrics_server

        metrics_server, metrics_port = start_metrics_server(config.metrics_addr, engine.metrics.registry)
        log.info("worker_metrics_serving", addr=config.metrics_addr, port=metrics_port)
    if config.control_plane:
        from worker.rpc.fetch import ControlPlaneFetcher
        from worker.rpc.membership import start_membership

        engine.fetcher = ControlPlaneFetcher(
            config.control_plane, engine.worker_id, secret=worker_secret_from(config.worker_secret)
        )
        hello = control_plane_pb2.WorkerHello(
            worker_id=engine.worker_id,
            addr=_advertised(config, port),
            model=str(engine.base.path),
            n_slots=config.n_slots,
            queue_limit=config.queue_limit,
            incarnation=uuid.uuid4().hex,
        )
        start_membership(
            config.control_plane,
            hello,
            stop,
            secret=worker_secret_from(config.worker_secret),
            holdings=lambda: holdings_of(engine),
            refresh=lambda h: refresh_hello(engine, h),
        )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"worker {engine.worker_id} listening on port {port}", flush=True)
    stop.wait()
    server.health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.stop(grace=2).wait()
    if metrics_server is not None:
        metrics_server.shutdown()
    engine.close()
