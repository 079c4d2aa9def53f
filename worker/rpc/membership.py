"""Worker side of membership: register with the control plane, then heartbeat.

`start_membership` starts one `MembershipThread` per control-plane address
(`control_plane_addresses` splits ``--control-plane A,B,C``), grouped in a `MembershipGroup`.
Each waits for its channel, calls ``RegisterWorker`` (retrying with `MembershipBackoff`,
interruptible through ``stop_event``), then ``Heartbeat`` every
``WorkerAck.heartbeat_interval_ms`` (every `JOIN_POLL_S` until the control plane answers
``joined=true``); a NOT_FOUND answer means the control plane forgot the worker, which registers
again. Calls carry the worker secret when one is configured; heartbeats carry what the worker
holds (``holdings``). The worker's own server must already be serving when this starts.

Joining, retries, several replicas: docs/architecture.md, "Joining" and "Replicas".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog

from loraplane.interceptors import pushback_s
from loraplane.v1 import membership_pb2, membership_pb2_grpc
from loraplane.worker_secret import with_secret

JOIN_POLL_S = 0.2
"""Heartbeat period while the control plane is still dialing us back / announcing adapters."""

Holdings = Callable[[], membership_pb2.WorkerHoldings]
Refresh = Callable[[membership_pb2.WorkerHello], None]
"""Writes what the worker holds in slots / its host tier and its paging counters into a hello."""

log = structlog.get_logger("loraplane.worker.rpc.membership")


@dataclass(frozen=True)
class MembershipBackoff:
    """Retry timing for registration.

    Attributes:
        connect_timeout_s: how long one attempt waits for the channel to become ready.
        register_timeout_s: deadline of one RegisterWorker call (it includes the control
            plane announcing every adapter to us).
        initial_s / max_s / multiplier: exponential backoff between failed attempts.
        heartbeat_timeout_s: deadline of one Heartbeat call.
    """

    connect_timeout_s: float = 5.0
    register_timeout_s: float = 300.0
    initial_s: float = 0.2
    max_s: float = 10.0
    multiplier: float = 2.0
    heartbeat_timeout_s: float = 5.0


class Wakeup:
    """Wakes every membership thread that subscribed (each has its own event) for a heartbeat
    now (`start_membership`'s ``wake``)."""

    def __init__(self) -> None:
        self._events: list[threading.Event] = []

    def subscribe(self) -> threading.Event:
        """A new event that `set` sets (one per membership thread)."""
        event = threading.Event()
        self._events.append(event)
        return event

    def set(self) -> None:
        """Heartbeat now, on every subscribed thread."""
        for event in self._events:
            event.set()


class _Membership:
    def __init__(
        self,
        addr: str,
        hello: membership_pb2.WorkerHello,
        stop: threading.Event,
        backoff: MembershipBackoff,
        credentials: grpc.ChannelCredentials | None,
        secret: str | None,
        holdings: Holdings | None,
        refresh: Refresh | None = None,
        wake: threading.Event | None = None,
    ) -> None:
        self.addr = addr
        self.hello = hello
        self.stop = stop
        self.backoff = backoff
        self.credentials = credentials
        self.secret = secret
        self.holdings = holdings
        self.refresh = refresh
        self.wake = wake
        self.registered = threading.Event()

    def _heartbeat_hello(self) -> membership_pb2.WorkerHello:
        hello = membership_pb2.WorkerHello()
        hello.CopyFrom(self.hello)
        if self.holdings is not None:
            hello.holdings.CopyFrom(self.holdings())
        if self.refresh is not None:
            self.refresh(hello)  # residency for affinity routing
        return hello

    def run(self) -> None:
        channel = (
            grpc.secure_channel(self.addr, self.credentials) if self.credentials else grpc.insecure_channel(self.addr)
        )
        stub = membership_pb2_grpc.WorkerMembershipStub(with_secret(channel, self.secret))
        log_ = log.bind(worker_id=self.hello.worker_id, control_plane=self.addr)
        try:
            while not self.stop.is_set():
                interval_s = self._register(channel, stub, log_)
                if interval_s is None:
                    return
                self._heartbeat_until_forgotten(stub, interval_s, log_)
        finally:
            channel.close()

    def _register(self, channel: grpc.Channel, stub, log_) -> float | None:
        """Register, retrying with backoff; the heartbeat interval, or None when stopped."""
        delay = self.backoff.initial_s
        while not self.stop.is_set():
            try:
                grpc.channel_ready_future(channel).result(timeout=self.backoff.connect_timeout_s)
                ack = stub.RegisterWorker(self.hello, timeout=self.backoff.register_timeout_s)
                interval_s = max(ack.heartbeat_interval_ms, 1) / 1000.0
                log_.info("worker_registration_accepted", heartbeat_interval_s=interval_s, joined=ack.joined)
                if ack.joined:
                    self.registered.set()
                return interval_s
            except grpc.FutureTimeoutError:
                log_.warning("control_plane_unreachable", retry_in_s=delay)
            except grpc.RpcError as exc:
                # UNAUTHENTICATED: the control plane wants a (different) worker secret; its
                # message says what to configure
                level = log_.error if exc.code() == grpc.StatusCode.UNAUTHENTICATED else log_.warning
                level("register_failed", code=exc.code().name, error=exc.details(), retry_in_s=delay)
            if self.stop.wait(delay):
                return None
            delay = min(delay * self.backoff.multiplier, self.backoff.max_s)
        return None

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds``, or less when ``wake`` is set (it is cleared); True when stopped."""
        if self.wake is None:
            return self.stop.wait(seconds)
        if self.wake.wait(seconds):
            self.wake.clear()
        return self.stop.is_set()

    def _heartbeat_until_forgotten(self, stub, interval_s: float, log_) -> None:
        """Heartbeat every interval (at once when ``wake`` is set) until stopped or the control
        plane no longer knows us."""
        while not self._sleep(interval_s if self.registered.is_set() else min(interval_s, JOIN_POLL_S)):
            try:
                ack = self._heartbeat(stub, interval_s)
                if ack.heartbeat_interval_ms:
                    interval_s = ack.heartbeat_interval_ms / 1000.0
                if ack.joined and not self.registered.is_set():
                    log_.info("worker_registered", heartbeat_interval_s=interval_s)
                    self.registered.set()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log_.warning("worker_forgotten_reregistering", error=exc.details())
                    self.registered.clear()
                    return
                log_.warning("heartbeat_failed", code=exc.code().name, error=exc.details())

    def _heartbeat(self, stub, interval_s: float) -> membership_pb2.WorkerAck:
        """One Heartbeat, retried on RESOURCE_EXHAUSTED for up to 3/4 of the interval.

        Raises:
            grpc.RpcError: the last failure.
        """
        hello = self._heartbeat_hello()
        give_up = time.monotonic() + 0.75 * interval_s
        while True:
            try:
                return stub.Heartbeat(hello, timeout=self.backoff.heartbeat_timeout_s)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                wait = min(pushback_s(exc.trailing_metadata()) or 0.05, interval_s / 4)
                if time.monotonic() + wait > give_up or self.stop.wait(wait):
                    raise


class MembershipThread(threading.Thread):
    """The register-then-heartbeat daemon thread.

    Attributes:
        registered: set while the control plane knows this worker (tests wait on it).
    """

    def __init__(self, membership: _Membership) -> None:
        super().__init__(target=membership.run, name=f"membership-{membership.hello.worker_id}", daemon=True)
        self.registered = membership.registered


class MembershipGroup:
    """One `MembershipThread` per control-plane address of a comma-separated list.

    Attributes:
        threads: the threads, in the order of the addresses.
        registered: set once every address has registered this worker (``wait``/``is_set``).
    """

    def __init__(self, threads: list[MembershipThread]) -> None:
        self.threads = threads
        self.registered = _AllSet([t.registered for t in threads])

    def join(self, timeout: float | None = None) -> None:
        for t in self.threads:
            t.join(timeout)

    def is_alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)


class _AllSet:
    """An Event-like view of several events: set when all of them are."""

    def __init__(self, events: list[threading.Event]) -> None:
        self.events = events

    def is_set(self) -> bool:
        return all(e.is_set() for e in self.events)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for e in self.events:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not e.wait(left):
                return False
        return True


def control_plane_addresses(spec: str) -> list[str]:
    """``"a:1, b:2"`` → ``["a:1", "b:2"]`` (duplicates dropped, order kept).

    Raises:
        ValueError: no address, or an empty element.
    """
    parts = [p.strip() for p in spec.split(",")]
    if not parts or not all(parts):
        raise ValueError(f"control-plane address list {spec!r} has an empty element")
    return list(dict.fromkeys(parts))


def start_membership(
    control_plane_addr: str,
    hello: membership_pb2.WorkerHello,
    stop_event: threading.Event,
    *,
    backoff: MembershipBackoff = MembershipBackoff(),
    credentials: grpc.ChannelCredentials | None = None,
    secret: str | None = None,
    holdings: Holdings | None = None,
    refresh: Refresh | None = None,
    wake: Wakeup | None = None,
) -> MembershipThread | MembershipGroup:
    """Start the register-then-heartbeat thread(s) (daemons) and return them.

    Args:
        control_plane_addr: one address, or several comma-separated (one thread each, a
            `MembershipGroup`; see the module docstring).
        secret: the worker secret, sent as metadata on every call (None: none sent).
        holdings: called before each heartbeat; what the worker holds (None: not reported).
        refresh: called on each heartbeat's hello: adapters resident in slots / on host and
            the paging counters (None: not reported).
        wake: ``wake.set()`` sends every thread's next heartbeat now instead of at the
            interval (a worker that starts draining tells the control plane at once); call it
            after setting ``stop_event`` too, to end the threads without waiting out the interval.

    Set ``stop_event`` to stop them; each exits within one heartbeat interval / backoff step.
    """
    addrs = control_plane_addresses(control_plane_addr)
    threads = [
        MembershipThread(
            _Membership(
                addr,
                hello,
                stop_event,
                backoff,
                credentials,
                secret,
                holdings,
                refresh,
                wake.subscribe() if wake is not None else None,
            )
        )
        for addr in addrs
    ]
    for thread in threads:
        thread.start()
    return threads[0] if len(threads) == 1 else MembershipGroup(threads)
