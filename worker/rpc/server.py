"""Worker process: gRPC server with the Worker service, standard health and reflection.

`create_server` binds (port 0 picks a free one), loads the model, and flips health to SERVING
once the model is ready; `serve_worker` also registers with the control plane
(``worker.rpc.membership``) and blocks until SIGINT/SIGTERM, then drains (`drain`) and stops
(`Shutdown`: by the drain timeout + `STOP_GRACE_S` at the latest). `server_interceptors` are,
outermost first: bounded status details (`loraplane.status_details`), the worker secret,
undecodable requests → INVALID_ARGUMENT, and the thread caps: ``Decode`` streams at most
``config.max_decode_streams``, ``LoadAdapter`` / ``UnloadAdapter`` at most `ADAPTER_OPS`, and
`RESERVED_THREADS` more that only short calls use. `holdings_of` and `refresh_hello` build
what heartbeats carry.

Drain and shutdown: docs/operations.md, "Stopping a worker: drain"; the thread caps:
"Limits and overload".
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Callable
from concurrent import futures

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from loraplane.interceptors import ConcurrencyLimitInterceptor, DecodeGuardInterceptor
from loraplane.limits import GRPC_MESSAGE_OPTIONS
from loraplane.reflection import enable_reflection
from loraplane.status_details import BoundedStatusInterceptor
from loraplane.v1 import common_pb2, membership_pb2, worker_pb2, worker_pb2_grpc
from loraplane.worker_secret import worker_guard, worker_secret_from
from worker.config import WorkerConfig
from worker.rpc import deadline
from worker.rpc.deadline import STOP_GRACE_S
from worker.rpc.servicer import WorkerServicer
from worker.serving.engine import WorkerEngine

log = structlog.get_logger("loraplane.worker.rpc.server")

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
ADAPTER_OPS = 2
"""Concurrent LoadAdapter/UnloadAdapter calls (the control plane announces one at a time per worker)."""
RESERVED_THREADS = 8
"""Pool threads beyond the streaming/adapter limits, left for Stats, ListAdapters, health."""


def server_interceptors(config: WorkerConfig) -> list[grpc.ServerInterceptor]:
    """Bounded status details, worker secret (if any), decode guard, concurrency limits — in that order."""
    limits = ConcurrencyLimitInterceptor(
        {
            "Decode stream": (config.max_decode_streams, f"/{SERVICE_NAME}/Decode".__eq__),
            "adapter load/unload": (
                ADAPTER_OPS,
                lambda m: m in (f"/{SERVICE_NAME}/LoadAdapter", f"/{SERVICE_NAME}/UnloadAdapter"),
            ),
        },
        hint=" (worker: --slots + --queue-limit)",
    )
    secret = worker_secret_from(config.worker_secret)
    guards = [worker_guard(secret)] if secret else []
    return [BoundedStatusInterceptor(), *guards, DecodeGuardInterceptor(), limits]


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
    servicer = WorkerServicer(engine)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server)
    port = server.add_insecure_port(config.addr)
    if port == 0:
        engine.close()
        raise RuntimeError(f"cannot bind worker address {config.addr}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    engine.scheduler.on_fatal.append(lambda _exc: _mark_unhealthy(engine, health_servicer))
    if engine.scheduler.failure is not None:  # stopped before the callback was in place
        _mark_unhealthy(engine, health_servicer)
    server.health_servicer = health_servicer  # kept for shutdown
    server.servicer = servicer  # its open Decode calls: the drain's end
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


def _mark_unhealthy(engine: WorkerEngine, health_servicer: health.HealthServicer) -> None:
    """The scheduler loop stopped for good (``Scheduler.on_fatal``): admit nothing (new
    requests get UNAVAILABLE, so the control plane retries them elsewhere; heartbeats say
    ``draining``) and report NOT_SERVING on both health names."""
    engine.draining.set()
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    log.critical("worker_not_serving", worker_id=engine.worker_id, reason="the scheduler loop stopped")


def holdings_of(engine: WorkerEngine) -> membership_pb2.WorkerHoldings:
    """What this worker holds, for heartbeats: usable adapters (id, sha256: every id it
    knows, whether its bytes are fetched yet or not) and draining ids."""
    draining = engine.draining_ids()
    return membership_pb2.WorkerHoldings(
        adapters=[
            membership_pb2.HeldAdapter(id=i, sha256=k.sha256)
            for i, k in sorted(engine.known().items())
            if i not in draining
        ],
        draining_ids=sorted(draining),
    )


def refresh_hello(engine: WorkerEngine, hello: membership_pb2.WorkerHello) -> None:
    """Write what ``engine`` holds now (resident / host / pinned adapter ids, paging counters,
    per-adapter page-ins and evictions, KV cells in use) and
    whether it is draining into ``hello`` — sent with every heartbeat so any control plane can
    route by affinity, and around a draining worker."""
    engine.host.trim()  # back to the host tier's cap at rest (a cancelled call's holds end late)
    st = engine.stats()
    hello.draining = engine.draining.is_set()
    del hello.resident_adapter_ids[:]
    hello.resident_adapter_ids.extend(st.resident_adapter_ids)
    del hello.host_adapter_ids[:]
    hello.host_adapter_ids.extend(st.host_adapter_ids)
    hello.paging.CopyFrom(
        common_pb2.WorkerPaging(
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
    hello.kv_cells_used = st.scheduler.kv_cells_used
    hello.kv_cells_total = st.scheduler.kv_cells_total
    del hello.pinned_adapter_ids[:]
    hello.pinned_adapter_ids.extend(st.pinned_adapter_ids)
    del hello.adapter_paging[:]
    hello.adapter_paging.extend(
        membership_pb2.AdapterPagingCount(adapter_id=i, page_ins=p, evictions=e)
        for i, (p, e) in sorted(engine.adapter_paging().items())
    )


def _advertised(config: WorkerConfig, port: int) -> str:
    if config.advertise_addr:
        return config.advertise_addr
    host = config.addr.rsplit(":", 1)[0] or "127.0.0.1"
    if host in ("0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


class SchedulerStoppedError(RuntimeError):
    """``serve_worker`` ends with this when the scheduler loop stopped for good
    (docs/operations.md, "Faults in the decode loop"): the process exits non-zero (``loraplane worker``:
    exit 1), so ``serve``'s supervisor or Kubernetes restarts it."""


class Shutdown:
    """How a worker process stops: the first SIGTERM/SIGINT starts a drain (``draining``), a
    second one (or the parent ``serve`` dying, `worker.rpc.parent`) stops now (``now``).

    Each step first arms the kernel deadline ``hard_stop`` (`worker.rpc.deadline.arm`;
    None: nothing is armed), then acts, and logs last: the process is gone ``drain_timeout_s``
    + `STOP_GRACE_S` seconds after the first signal and `STOP_GRACE_S` seconds after a second
    one at the latest, whatever else happens in it (a log line blocked on a stderr pipe nobody
    reads, a stuck thread). The orderly stop normally ends long before.
    """

    def __init__(self, drain_timeout_s: float = 0.0, hard_stop: Callable[[float], None] | None = None) -> None:
        self.draining = threading.Event()
        self.now = threading.Event()
        self.drain_timeout_s = drain_timeout_s
        self._hard_stop = hard_stop

    def on_signal(self, signum: int, _frame: object = None) -> None:
        """Signal handler: drain on the first signal, stop now on the next."""
        if self.draining.is_set():
            self.stop_now()
            log.warning("worker_stopping_now", signal=signal.Signals(signum).name)
        else:
            self.start_drain()
            log.info("worker_drain_requested", signal=signal.Signals(signum).name)

    def start_drain(self) -> None:
        """Start a drain: the process ends ``drain_timeout_s`` + `STOP_GRACE_S` from now at the latest."""
        if self._hard_stop is not None:
            self._hard_stop(self.drain_timeout_s + STOP_GRACE_S)
        self.draining.set()

    def stop_now(self) -> None:
        """Stop without waiting for in-flight generations (any thread): the process ends
        `STOP_GRACE_S` from now at the latest."""
        if self._hard_stop is not None:
            self._hard_stop(STOP_GRACE_S)
        self.now.set()
        self.draining.set()


def drain(
    server: grpc.Server, engine: WorkerEngine, servicer: WorkerServicer, shutdown: Shutdown, timeout_s: float
) -> bool:
    """Report NOT_SERVING, refuse new requests (UNAVAILABLE: the control plane retries them on
    another worker), and wait up to ``timeout_s`` seconds for the open Decode calls to end
    (``shutdown.now`` cuts the wait short). True when none is left open.

    The caller has told the control plane already (a heartbeat with ``draining``) or does so
    right after; Kubernetes sends SIGTERM ``terminationGracePeriodSeconds`` before SIGKILL, so
    ``timeout_s`` (``--drain-timeout``) must stay below it.
    """
    engine.draining.set()
    server.health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    open_calls = servicer.open_decode_calls()
    log.info("worker_draining", worker_id=engine.worker_id, open_decode_calls=open_calls, drain_timeout_s=timeout_s)
    done = servicer.wait_decode_idle(timeout_s, shutdown.now)
    if done:
        log.info("worker_drained", worker_id=engine.worker_id)
    else:
        log.warning(
            "worker_drain_cut_short",
            worker_id=engine.worker_id,
            open_decode_calls=servicer.open_decode_calls(),
            reason="second signal or parent gone" if shutdown.now.is_set() else f"--drain-timeout {timeout_s:g}s",
        )
    return done


def _supervisor_restarts() -> int:
    """``$LORAPLANE_WORKER_RESTARTS`` (set by ``serve``), 0 when unset or not a number."""
    from loraplane.env import ENV_WORKER_RESTARTS

    value = os.environ.pop(ENV_WORKER_RESTARTS, "")
    return int(value) if value.isdigit() else 0


def serve_worker(config: WorkerConfig) -> None:
    """Run a worker until SIGINT/SIGTERM; registers with ``config.control_plane`` when set.

    SIGTERM (or SIGINT) drains: health NOT_SERVING, heartbeats say ``draining`` (one is sent at
    once, so the control plane routes around this worker), new requests are refused with
    UNAVAILABLE, and in-flight generations run to their end for up to ``config.drain_timeout_s``
    seconds; then the process exits. A second signal stops at once. Started by ``serve``
    (``$LORAPLANE_PARENT_FD``), it also stops at once when ``serve`` dies (`worker.rpc.parent`).
    Whatever else happens, the kernel ends the process `STOP_GRACE_S` seconds after the drain
    timeout, a second signal or ``serve``'s death (`Shutdown`, `worker.rpc.deadline`).

    Raises:
        SchedulerStoppedError: the scheduler loop stopped for good (``Scheduler.on_fatal``):
            the worker reported NOT_SERVING, heartbeated ``draining`` and stopped at once; the
            caller exits non-zero so that the process is restarted.
    """
    from loraplane.logging import configure_logging  # one JSON log format for both planes
    from worker.rpc.parent import watch_parent_from_env

    configure_logging(config.log_level)
    deadline.install()  # SIGALRM at its default action: the stops' deadline ends the process
    parent = watch_parent_from_env()  # first: serve may die while the model loads
    from loraplane.progress import progress_enabled, spinner
    from worker.serving.heap import limit_arenas

    limit_arenas()  # before the gRPC and OpenMP threads exist (worker.serving.heap)

    with spinner("loading the model", enabled=progress_enabled()):
        server, port, engine = create_server(config)
    # until here, SIGTERM/SIGINT end the process as Python's defaults do
    shutdown = Shutdown(config.drain_timeout_s, hard_stop=deadline.arm)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, shutdown.on_signal)
    if parent is not None:
        parent.on_parent_death = shutdown.stop_now
    # The scheduler loop stopping for good ends the process, non-zero (below): serve and
    # Kubernetes restart a worker that exits, never one that only stopped serving.
    engine.scheduler.on_fatal.append(lambda _exc: shutdown.stop_now())
    if engine.scheduler.failure is not None:
        shutdown.stop_now()
    stop = threading.Event()
    wake = None
    metrics_server = None
    if config.metrics_addr:
        from loraplane.metrics import start_metrics_server

        metrics_server, metrics_port = start_metrics_server(config.metrics_addr, engine.metrics.registry)
        log.info("worker_metrics_serving", addr=config.metrics_addr, port=metrics_port)
    warmup = engine.grammar_warmup
    while warmup is not None and warmup.is_alive() and not shutdown.draining.is_set():
        # before registering: the engine holds the interpreter lock for up to ~1 s at a time
        # while it builds, and no heartbeat should wait on that
        warmup.join(0.1)
    if config.control_plane:
        from worker.rpc.fetch import ControlPlaneFetcher
        from worker.rpc.membership import Wakeup, start_membership

        engine.fetcher = ControlPlaneFetcher(
            config.control_plane, engine.worker_id, secret=worker_secret_from(config.worker_secret)
        )
        hello = membership_pb2.WorkerHello(
            worker_id=engine.worker_id,
            addr=_advertised(config, port),
            model=str(engine.base.path),
            n_slots=config.n_seqs,
            queue_limit=config.queue_limit,
            n_ctx=config.n_ctx_seq,
            incarnation=uuid.uuid4().hex,
            supervisor_restarts=_supervisor_restarts(),
        )
        wake = Wakeup()
        start_membership(
            config.control_plane,
            hello,
            stop,
            secret=worker_secret_from(config.worker_secret),
            holdings=lambda: holdings_of(engine),
            refresh=lambda h: refresh_hello(engine, h),
            wake=wake,
        )
    print(f"worker {engine.worker_id} listening on port {port}", flush=True)
    shutdown.draining.wait()
    # refuse and report NOT_SERVING before the heartbeat that says "draining" goes out
    engine.draining.set()
    server.health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    if wake is not None:
        wake.set()  # heartbeat "draining" now: the control plane stops routing here
    if not shutdown.now.is_set():
        drain(server, engine, server.servicer, shutdown, config.drain_timeout_s)
    stop.set()
    if wake is not None:
        wake.set()
    server.health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    # A loop that stopped for good has just ended every call with its error (INTERNAL for the
    # running ones): a second of grace lets those statuses reach the clients, where grace 0
    # cancelled a call whose error was still on its way (UNAVAILABLE "Cancelling all calls").
    failed = engine.scheduler.failure is not None
    server.stop(grace=1 if failed or not shutdown.now.is_set() else 0).wait()
    if metrics_server is not None:
        metrics_server.shutdown()
    engine.close()
    failure = engine.scheduler.failure
    if failure is not None:
        raise SchedulerStoppedError(
            f"worker {engine.worker_id}: the scheduler loop stopped ({type(failure).__name__}: {failure}); "
            "exiting so that the supervisor restarts the worker"
        ) from failure
