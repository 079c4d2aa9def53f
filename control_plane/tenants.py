"""Tenants: who a request is accounted to, their API keys, and their names' rules.

One `TenantDirectory` per control-plane process maps key hashes to tenants and tenants to their
limits; it reloads keys from the store every `KEYS_REFRESH_S`, limits with every quota sync
(`control_plane.quotas`), and at once after an admin change made through this replica.
`tenant_of` picks a request's tenant (the ``--api-key`` or admin token, a tenant key, the
explicit adapter map, else ``"anonymous"``); `generate_key`, `check_key` and `key_hash` make and
check keys, stored as their sha256 only; `check_tenant_name` checks names.

The resolution rules, key rules, why one plain sha256 suffices, and staleness across replicas:
docs/tenants.md, "The tenant of a request".
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from control_plane.auth import bearer_token
from control_plane.errors import InvalidArgumentError
from control_plane.store.tenant_records import TenantRecord
from loraplane.interceptors import secret_matches
from loraplane.metrics import OTHER_LABEL

log = structlog.get_logger("loraplane.control_plane.tenants")

DEFAULT_TENANT = "default"
"""The tenant of the inference ``--api-key`` and of the admin token."""
ANONYMOUS_TENANT = "anonymous"
"""The tenant of requests with no key and no explicit adapter map."""
ADAPTER_TENANT_PREFIX = "adapter:"
MAX_NAME_CHARS = 128
RESERVED_TENANT_NAMES = (OTHER_LABEL,)
"""Names no tenant may be given: ``other`` is the metrics' overflow label (`loraplane.metrics`)."""
MIN_KEY_CHARS = 16
"""A given API key shorter than this is refused: keys are stored as one fast hash, which is
only safe for high-entropy secrets."""
MAX_KEY_CHARS = 512
KEY_PREFIX = "lp-"
KEYS_REFRESH_S = 1.0
"""Seconds between reloads of the key table from the store."""


def check_tenant_name(name: str, *, new: bool = False) -> str:
    """``name`` when it can name a tenant: 1 to `MAX_NAME_CHARS` printable characters, no
    leading or trailing blank. ``default``, ``anonymous`` and ``adapter:…`` are allowed (rows
    for them give limits to that traffic; see the module docstring). A ``new`` tenant may not
    take a `RESERVED_TENANT_NAMES` name (a row made before that rule can still be changed or
    removed).

    Raises:
        InvalidArgumentError: naming the fault.
    """
    if not name:
        raise InvalidArgumentError("tenant name is empty")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidArgumentError(f"tenant name has {len(name)} characters; at most {MAX_NAME_CHARS}")
    if new and name in RESERVED_TENANT_NAMES:
        raise InvalidArgumentError(
            f"tenant name '{name}' is reserved: the metrics' tenant label counts every tenant past "
            "the label cap (--metrics-max-adapters) under it; pick another"
        )
    if not name.isprintable():
        raise InvalidArgumentError(f"tenant name {name!r} holds a non-printable character")
    if name != name.strip():
        raise InvalidArgumentError(f"tenant name {name!r} begins or ends with a blank")
    return name


def generate_key() -> str:
    """A new API key: ``lp-`` + 32 random bytes, URL-safe base64 (43 characters)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def check_key(key: str) -> str:
    """``key`` when it can be an API key: `MIN_KEY_CHARS` to `MAX_KEY_CHARS` printable ASCII
    characters without blanks (it travels as ``Authorization: Bearer <key>``).

    Raises:
        InvalidArgumentError: naming the fault, never echoing the key.
    """
    if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS:
        raise InvalidArgumentError(
            f"API key has {len(key)} characters; give {MIN_KEY_CHARS} to {MAX_KEY_CHARS} (or none: one is generated)"
        )
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise InvalidArgumentError("API key must be printable ASCII without blanks (it is sent as a bearer token)")
    return key


def key_hash(key: str) -> str:
    """The stored form of an API key: sha256 of its UTF-8 bytes, hex (see the module docstring)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ResolvedTenant:
    """The tenant a request is accounted to, as the router and the worker need it.

    Attributes:
        name: the tenant (`tenant_of`).
        record: its row when it has one (limits apply), else None (no limits).
    """

    name: str
    record: TenantRecord | None = None

    @property
    def weight(self) -> float:
        return self.record.weight if self.record is not None else 1.0

    @property
    def priority(self) -> int:
        return self.record.priority if self.record is not None else 0


@dataclass
class TenantDirectory:
    """Keys → tenant and tenant → record, in memory (see the module docstring).

    Args:
        api_key: the inference ``--api-key`` (None: not configured).
        admin_token: the admin token (None: not configured).

    Thread-safe: request threads read it, the quota sync replaces its tables.
    """

    api_key: str | None = None
    admin_token: str | None = None
    _keys: dict[str, str] = field(default_factory=dict)
    _records: dict[str, TenantRecord] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set_keys(self, keys: Mapping[str, str]) -> None:
        """Replace the key table (``{sha256: tenant}``, `AdapterStore.tenant_keys`)."""
        with self._lock:
            self._keys = dict(keys)

    def set_records(self, records: Sequence[TenantRecord]) -> None:
        """Replace the tenant table."""
        with self._lock:
            self._records = {r.name: r for r in records}

    def record(self, name: str) -> TenantRecord | None:
        """The row of tenant ``name``, or None (no limits)."""
        with self._lock:
            return self._records.get(name)

    def records(self) -> list[TenantRecord]:
        """Every known row, by name."""
        with self._lock:
            return sorted(self._records.values(), key=lambda r: r.name)

    def tenant_of_key(self, key: str) -> str | None:
        """The tenant whose API key ``key`` is, or None."""
        digest = key_hash(key)
        with self._lock:
            return self._keys.get(digest)

    def principal(self, authorization: str | None) -> str | None:
        """Rules 1-2 of `tenant_of` for an ``authorization`` header / metadata value:
        ``"default"`` for the API key or the admin token, else the tenant its bearer token
        names; None for no token or an unknown one."""
        token = bearer_token(authorization or "")
        if token is None:
            return None
        if self.is_server_credential(token):
            return DEFAULT_TENANT
        return self.tenant_of_key(token)

    def is_server_credential(self, token: str) -> bool:
        """Whether ``token`` is this control plane's own ``--api-key`` or admin token (compared
        in constant time): those name ``"default"`` and are never a tenant's key."""
        return any([secret_matches(token, s) for s in (self.api_key, self.admin_token) if s])

    def accepts(self, token: str) -> bool:
        """Whether ``token`` is some tenant's API key (the API-key check's extra acceptance)."""
        return self.tenant_of_key(token) is not None

    def resolve(self, principal: str | None, first_adapter: str | None) -> ResolvedTenant:
        """`tenant_of` with this directory's rows."""
        name = tenant_of(principal, first_adapter)
        return ResolvedTenant(name, self.record(name))


def tenant_of(principal: str | None, first_adapter: str | None) -> str:
    """The tenant name of a request (rules in the module docstring).

    Args:
        principal: what its key named (`TenantDirectory.principal`), None without one.
        first_adapter: the name (or id) of the first adapter of its explicit map; None when
            the map is unset (the default set) or empty (the base model).
    """
    if principal:
        return principal
    if first_adapter:
        return ADAPTER_TENANT_PREFIX + first_adapter
    return ANONYMOUS_TENANT
