"""Worker process: gRPC server with the Worker service, standard health and reflection.

``create_server`` binds (port 0 picks a free one), loads the model, and flips health to
SERVING once the model is ready; ``serve_worker`` also registers with the control plane and
blocks until SIGINT/SIGTERM, then reports NOT_SERVING and stops.
"""

from __future__ import annotations

import signal
import threading
from concurrent import futures

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraplane.limits import GRPC_MESSAGE_OPTIONS
from loraplane.v1 import control_plane_pb2, worker_pb2, worker_pb2_grpc
from worker.config import WorkerConfig
from worker.serving.engine import WorkerEngine
from worker.rpc.servicer import WorkerServicer

log = structlog.get_logger("loraplane.worker.rpc.server")

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


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
        futures.ThreadPoolExecutor(max_workers=max(16, 4 * config.n_slots + 8)),
        options=GRPC_MESSAGE_OPTIONS,
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(engine), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(config.addr)
    if port == 0:
        engine.close()
        raise RuntimeError(f"cannot bind worker address {config.addr}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    server.health_servicer = health_servicer  # kept for shutdown
    log.info("worker serving", addr=config.addr, port=port, worker_id=engine.worker_id,
             model=str(engine.base.path), device=str(engine.base.device), dtype=config.dtype,
             batching=config.batching.value, prefix_cache=config.prefix_cache.value)
    return server, port, engine


def refresh_hello(engine: WorkerEngine, hello: control_plane_pb2.WorkerHello) -> None:
    """Write what ``engine`` holds now (resident / host adapter ids, paging counters) into
    ``hello`` — sent with every heartbeat so any control plane can route by affinity."""
    st = engine.stats()
    del hello.resident_adapter_ids[:]
    hello.resident_adapter_ids.extend(st.resident_adapter_ids)
    del hello.host_adapter_ids[:]
    hello.host_adapter_ids.extend(st.host_adapter_ids)
    hello.paging.CopyFrom(control_plane_pb2.WorkerPaging(
        max_loras=st.max_loras, max_cpu_loras=st.max_cpu_loras, resident=st.resident_adapters,
        host=st.host_adapters, page_ins=st.page_ins, evictions=st.evictions, fetches=st.fetches,
        fetch_bytes=st.fetch_bytes, page_in_bytes=st.page_in_bytes, host_evictions=st.host_evictions))


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
    server, port, engine = create_server(config)
    stop = threading.Event()
    if config.control_plane:
        from worker.rpc.membership import start_membership

        from worker.rpc.fetch import ControlPlaneFetcher

        engine.fetcher = ControlPlaneFetcher(config.control_plane, engine.worker_id)
        hello = control_plane_pb2.WorkerHello(worker_id=engine.worker_id, addr=_advertised(config, port),
                                              model=str(engine.base.path), n_slots=config.n_slots)
        refresh_hello(engine, hello)
        start_membership(config.control_plane, hello, stop, refresh=lambda h: refresh_hello(engine, h))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"worker {engine.worker_id} listening on port {port}", flush=True)
    stop.wait()
    server.health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.stop(grace=2).wait()
    engine.close()
