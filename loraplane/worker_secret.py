"""The worker secret: what proves a caller is one of *our* planes.

One shared secret, distinct from the admin token, configured on the control plane and on every
worker (``--worker-secret`` or ``$LORAPLANE_WORKER_SECRET``; ``serve`` generates one for its
own worker). It travels as ``loraplane-worker-secret`` metadata:

- worker → control plane: ``RegisterWorker`` and ``Heartbeat`` (`membership_guard`);
- control plane → worker: every ``loraplane.v1.Worker`` RPC (`worker_guard`). The standard
  health and reflection services stay open so probes work without it.

Without a secret configured both checks are off (as before this existed); the docs say to
firewall the worker port and the control plane's membership then. Plain metadata is readable
on the wire: across hosts, run both planes with TLS (``--tls-cert``/``--tls-key``) or mTLS.
"""

from __future__ import annotations

import os
import secrets

import grpc

from loraplane.env import ENV_WORKER_SECRET
from loraplane.interceptors import MetadataClientInterceptor, SharedSecretInterceptor

WORKER_SECRET_KEY = "loraplane-worker-secret"
"""Metadata key carrying the worker secret (gRPC keys are lower case)."""

MEMBERSHIP_METHODS = frozenset({"/loraplane.v1.ControlPlane/RegisterWorker", "/loraplane.v1.ControlPlane/Heartbeat"})
FETCH_METHODS = frozenset({"/loraplane.v1.ControlPlane/FetchAdapter"})
"""Worker → control plane calls outside membership that need the secret too (adapter bytes)."""
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
    """Control-plane interceptor: RegisterWorker/Heartbeat and FetchAdapter need the secret."""
    return SharedSecretInterceptor(
        secret,
        key=WORKER_SECRET_KEY,
        applies=lambda m: m in MEMBERSHIP_METHODS or m in FETCH_METHODS,
        what="worker secret",
    )


def worker_guard(secret: str) -> SharedSecretInterceptor:
    """Worker interceptor: every Worker RPC needs the secret (health/reflection stay open)."""
    return SharedSecretInterceptor(
        secret, key=WORKER_SECRET_KEY, applies=lambda m: m.startswith(WORKER_SERVICE_PREFIX), what="worker secret"
    )
