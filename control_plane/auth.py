"""The admin bearer token and the inference API key: how they are configured, parsed and checked,
on gRPC and HTTP.

`admin_token_from` and `api_key_from` read the flag or its environment variable;
`bearer_token` parses the ``authorization`` header and `check_bearer` / `check_api_key` compare
in constant time. On gRPC, `AdminAuthInterceptor` guards `ADMIN_METHODS` and `ApiKeyInterceptor`
every other ``ControlPlane`` method; the HTTP front applies the same rules to
`ADMIN_HTTP_PATHS` and to every route outside `OPEN_HTTP_PATHS` (``control_plane.http.api_key``).
Tenant keys pass the API-key check but never the admin one. Worker membership is guarded by the
worker secret instead (`loraplane.worker_secret`).

Who may call what, and why: docs/security.md, "Admin token" and "Inference API key".
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable

from loraplane.env import ENV_ADMIN_TOKEN, ENV_API_KEY
from loraplane.interceptors import SharedSecretInterceptor, secret_matches
from loraplane.worker_secret import WORKER_METHODS

_SERVICE = "/loraplane.v1.ControlPlane/"
ADMIN_METHODS = frozenset(
    _SERVICE + m
    for m in (
        "RegisterAdapter",
        "UnregisterAdapter",
        "SetDefaultAdapters",
        "PinAdapter",
        "AddTenant",
        "UpdateTenant",
        "ListTenants",
        "RemoveTenant",
    )
)


def admin_token_from(flag: str | None) -> str | None:
    """The configured token: the flag, else the environment; None (or empty) disables the check."""
    token = flag if flag else os.environ.get(ENV_ADMIN_TOKEN, "")
    return token or None


def api_key_from(flag: str | None) -> str | None:
    """The configured inference API key: the flag, else ``$LORAPLANE_API_KEY``; None (or
    empty) disables the check."""
    key = flag if flag else os.environ.get(ENV_API_KEY, "")
    return key or None


def needs_api_key(method: str) -> bool:
    """Whether the full gRPC method name is guarded by the API key: every ``ControlPlane``
    method except the worker RPCs (those carry the worker secret). Health and reflection live in
    other services and stay open."""
    return method.startswith(_SERVICE) and method not in WORKER_METHODS


def bearer_token(authorization: str) -> str | None:
    """The token of an ``authorization`` value ``Bearer <token>`` (scheme in any case,
    surrounding blanks stripped); None for another scheme or an empty token."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


ADMIN_HTTP_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/tenants")
"""HTTP paths (and, for ``/v1/tenants``, the paths below it) a tenant key does not open."""


def is_admin_http_path(path: str) -> bool:
    """Whether ``path`` is an admin route (`ADMIN_HTTP_PATHS`)."""
    return any(path == p or path.startswith(p + "/") for p in ADMIN_HTTP_PATHS)


OPEN_HTTP_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/openapi.json"})
"""HTTP paths served without the API key: probes (``/ping`` is vLLM's and SageMaker's), the
server's version, scrapes and the API's schema (vLLM leaves
everything outside ``/v1`` open; we guard every other path, so routes added later are too)."""


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


def check_api_key(
    authorization: str | None,
    api_key: str,
    admin_token: str | None,
    accept: Callable[[str], bool] | None = None,
) -> BearerCheck:
    """`check_bearer` for the inference API key, the admin token accepted as well (both compared
    in constant time, whichever matched), and any token ``accept`` accepts (a tenant key);
    never raises."""
    presented = bearer_token(authorization or "")
    if presented is None:
        return BearerCheck.MISSING
    matches = [secret_matches(presented, s) for s in (api_key, admin_token) if s]
    if any(matches) or (accept is not None and accept(presented)):
        return BearerCheck.ACCEPTED
    return BearerCheck.REJECTED


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


class ApiKeyInterceptor(SharedSecretInterceptor):
    """Refuses the methods `needs_api_key` names without the API key or the admin token as
    bearer token (UNAUTHENTICATED; constant-time comparison).

    Args:
        api_key: the inference key.
        admin_token: also accepted (None: only the key).
        tenant_key: ``tenant_key(token)``: whether ``token`` is a tenant's API key, accepted
            for every method but `ADMIN_METHODS` (None: no tenant keys).
    """

    def __init__(
        self, api_key: str, admin_token: str | None = None, tenant_key: Callable[[str], bool] | None = None
    ) -> None:
        def accept(method: str, token: str) -> bool:
            return tenant_key is not None and method not in ADMIN_METHODS and tenant_key(token)

        super().__init__(
            api_key,
            key="authorization",
            applies=needs_api_key,
            what="API key ('authorization: Bearer <key>')",
            extract=bearer_token,
            also=(admin_token,) if admin_token else (),
            accept=accept,
        )
