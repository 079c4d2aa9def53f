"""The admin bearer token: how it is configured, parsed and checked (gRPC and HTTP).

When a token is configured (``--admin-token`` or ``$LORAPLANE_ADMIN_TOKEN``), the methods in
`ADMIN_METHODS` need ``authorization: Bearer <token>`` metadata, else UNAUTHENTICATED
(`AdminAuthInterceptor`); the HTTP front's admin routes need the same header, else 401
(`check_bearer`). Both read the header with `bearer_token` and compare in constant time with
`loraplane.interceptors.secret_matches`. Every other method (reads, Generate) stays open;
worker membership is guarded by the worker secret instead (`loraplane.worker_secret`). With no
token configured nothing is checked.
"""

from __future__ import annotations

import enum
import os

from loraplane.env import ENV_ADMIN_TOKEN
from loraplane.interceptors import SharedSecretInterceptor, secret_matches

_SERVICE = "/loraplane.v1.ControlPlane/"
ADMIN_METHODS = frozenset(
    _SERVICE + m for m in ("RegisterAdapter", "UnregisterAdapter", "SetDefaultAdapters", "PinAdapter")
)


def admin_token_from(flag: str | None) -> str | None:
    """The configured token: the flag, else the environment; None (or empty) disables the check."""
    token = flag if flag else os.environ.get(ENV_ADMIN_TOKEN, "")
    return token or None


def bearer_token(authorization: str) -> str | None:
    """The token of an ``authorization`` value ``Bearer <token>`` (scheme in any case,
    surrounding blanks stripped); None for another scheme or an empty token."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class BearerCheck(enum.Enum):
    """What `check_bearer` found in an ``authorization`` header."""

    ACCEPTED = "accepted"
    MISSING = "missing"  # no header, another scheme, or an empty token
    REJECTED = "rejected"  # a bearer token that is not the configured one


def check_bearer(authorization: str | None, token: str) -> BearerCheck:
    """Whether the ``authorization`` header carries ``token`` as its bearer token
    (constant-time comparison); never raises."""
    presented = bearer_token(authorization or "")
    if presented is None:
        return BearerCheck.MISSING
    return BearerCheck.ACCEPTED if secret_matches(presented, token) else BearerCheck.REJECTED


class AdminAuthInterceptor(SharedSecretInterceptor):
    """Refuses admin methods without the right bearer token (constant-time comparison)."""

    def __init__(self, token: str) -> None:
        super().__init__(
            token,
            key="authorization",
            applies=ADMIN_METHODS.__contains__,
            what="admin token ('authorization: Bearer <token>')",
            extract=bearer_token,
        )
