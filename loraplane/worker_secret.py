"""The worker secret: what proves a caller is one of *our* planes.

One shared secret, distinct from the admin token, configured on the control plane and on every
worker (``--worker-secret`` or ``$LORAPLANE_WORKER_SECRET``; ``serve`` generates one for its
own worker). It travels as ``loraplane-worker-secret`` metadata:

- worker → control plane: every ``loraplane.v1.WorkerMembership`` RPC (``RegisterWorker``,
  ``Heartbeat``, ``FetchAdapter``; `membership_guard`);
- control plane → worker: every ``loraplane.v1.Worker`` RPC (`worker_guard`). The standard
  health and reflection services stay open so probes work without it.

A control plane without a secret refuses the worker RPCs (`ClosedDoorInterceptor`, UNAUTHENTICATED
naming what to do) unless its operator passed ``--insecure-workers`` (open, as before: for a
trusted network only). A worker without a secret sends none and checks none (it works against
an ``--insecure-workers`` control plane; firewall its port). Plain metadata is readable on the
wire: across hosts, run both planes with TLS (``--tls-cert``/``--tls-key``) or mTLS.
"""

from __future__ import annotations

import os
import secrets

import grpc

from loraplane.env import ENV_WORKER_SECRET
from loraplane.interceptors import MetadataClientInterceptor, SharedSecretInterceptor, refusal

WORKER_SECRET_KEY = "loraplane-worker-secret"
"""Metadata key carrying the worker secret (gRPC keys are lower case)."""

MEMBERSHIP_SERVICE_PREFIX = "/loraplane.v1.WorkerMembership/"
"""The service of every RPC only workers make on the control plane (``membership.proto``)."""
MEMBERSHIP_METHODS = frozenset({MEMBERSHIP_SERVICE_PREFIX + "RegisterWorker", MEMBERSHIP_SERVICE_PREFIX + "Heartbeat"})
FETCH_METHODS = frozenset({MEMBERSHIP_SERVICE_PREFIX + "FetchAdapter"})
"""Worker → control plane calls outside membership that need the secret too (adapter bytes)."""
WORKER_METHODS = MEMBERSHIP_METHODS | FETCH_METHODS
"""Every control-plane RPC only workers make today."""


def is_worker_method(method: str) -> bool:
    """Whether ``method`` (``/pkg.Service/Method``) belongs to the ``WorkerMembership`` service:
    guarded by the secret, or closed without one (a method added to it later is guarded too)."""
    return method.startswith(MEMBERSHIP_SERVICE_PREFIX)


NO_SECRET_HINT = (
    "start the control plane with --worker-secret or $LORAPLANE_WORKER_SECRET and give the same "
    "secret to workers, or --insecure-workers on a trusted network"
)
"""What to do when a control plane has no worker secret (in refusals and the start-up log)."""
WORKER_SERVICE_PREFIX = "/loraplane.v1.Worker/"


def worker_secret_from(flag: str | None) -> str | None:
    """The configured secret: the flag, else ``$LORAPLANE_WORKER_SECRET``; None when neither."""
    value = flag if flag else os.environ.get(ENV_WORKER_SECRET, "")
    return value or None


def new_worker_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text) for ``serve``'s own worker."""
    return secrets.token_urlsafe(32)


def with_secret(channel: grpc.Channel, secret: str | None) -> grpc.Channel:
    """``channel`` sending the secret on every call (unchanged when ``secret`` is None)."""
    if not secret:
        return channel
    return grpc.intercept_channel(channel, MetadataClientInterceptor([(WORKER_SECRET_KEY, secret)]))


def membership_guard(secret: str) -> SharedSecretInterceptor:
    """Control-plane interceptor: every WorkerMembership RPC (RegisterWorker, Heartbeat,
    FetchAdapter) needs the secret."""
    return SharedSecretInterceptor(
        secret,
        key=WORKER_SECRET_KEY,
        applies=is_worker_method,
        what="worker secret",
    )


class ClosedDoorInterceptor(grpc.ServerInterceptor):
    """Control-plane interceptor without a secret nor ``--insecure-workers``: every worker RPC
    (`is_worker_method`) is refused UNAUTHENTICATED, the message saying what to do
    (`NO_SECRET_HINT`). Nothing is deserialized and no limiter permit is taken."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not is_worker_method(method):
            return handler
        return refusal(
            handler,
            grpc.StatusCode.UNAUTHENTICATED,
            f"{method}: this control plane has no worker secret, so workers cannot join: {NO_SECRET_HINT}",
            event="worker_rpc_refused_no_secret",
            method=method,
        )


def worker_door(secret: str | None, insecure: bool) -> list[grpc.ServerInterceptor]:
    """The control plane's interceptors for worker RPCs: the secret's guard when a secret is
    configured (``insecure`` is then ignored), none with ``insecure`` (open), else the closed
    door (`ClosedDoorInterceptor`)."""
    if secret:
        return [membership_guard(secret)]
    if insecure:
        return []
    return [ClosedDoorInterceptor()]


def worker_guard(secret: str) -> SharedSecretInterceptor:
    """Worker interceptor: every Worker RPC needs the secret (health/reflection stay open)."""
    return SharedSecretInterceptor(
        secret, key=WORKER_SECRET_KEY, applies=lambda m: m.startswith(WORKER_SERVICE_PREFIX), what="worker secret"
    )
