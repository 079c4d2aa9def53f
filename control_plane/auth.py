"""Bearer-token check for the admin RPCs, as one gRPC server interceptor.

When a token is configured (``--admin-token`` or ``$LORAPLANE_ADMIN_TOKEN``), the methods in
`ADMIN_METHODS` need ``authorization: Bearer <token>`` metadata, else UNAUTHENTICATED. Every
other method (reads, Generate) stays open; worker membership is guarded by the worker
secret instead (`loraplane.worker_secret`). With no token configured nothing
is checked.
"""

from __future__ import annotations

import os

from loraplane.env import ENV_ADMIN_TOKEN
from loraplane.interceptors import SharedSecretInterceptor

_SERVICE = "/loraplane.v1.ControlPlane/"
ADMIN_METHODS = frozenset(
    _SERVICE + m for m in ("RegisterAdapter", "UnregisterAdapter", "SetDefaultAdapters", "PinAdapter")
)


def admin_token_from(flag: str | None) -> str | None:
    """The configured token: the flag, else the environment; None (or empty) disables the check."""
    token = flag if flag else os.environ.get(ENV_ADMIN_TOKEN, "")
    return token or None


def _bearer(value: str) -> str | None:
    """The token of ``Bearer <token>``; None for any other scheme."""
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class AdminAuthInterceptor(SharedSecretInterceptor):
    """Refuses admin methods without the right bearer token (constant-time comparison)."""

    def __init__(self, token: str) -> None:
        super().__init__(
            token,
            key="authorization",
            applies=ADMIN_METHODS.__contains__,
            what="admin token ('authorization: Bearer <token>')",
            extract=_bearer,
        )
