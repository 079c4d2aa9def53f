"""The tenant admin operations (``AddTenant``, ``UpdateTenant``, ``ListTenants``,
``RemoveTenant`` and the HTTP front's ``/v1/tenants`` routes): checks, the store write, and an
immediate refresh of this replica's directory and quota book so the change applies here at once
(other replicas pick it up within their refresh interval, `control_plane.tenants`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from control_plane.errors import MAX_LISTED, AlreadyExistsError, InvalidArgumentError, NotFoundError
from control_plane.quotas import QuotaBook, TenantUsageView
from control_plane.store import AdapterStore
from control_plane.store.tenant_records import TENANT_SETTINGS, TenantRecord
from control_plane.tenants import check_key, check_tenant_name, generate_key, key_hash

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
INT63_MAX = 2**63 - 1
MAX_WEIGHT = 1e6

_BOUNDS: dict[str, tuple[int, int]] = {
    "priority": (-INT32_MAX - 1, INT32_MAX),
    "max_concurrent": (0, UINT32_MAX),
    "tokens_per_minute": (0, INT63_MAX),
    "requests_per_minute": (0, INT63_MAX),
}


def check_settings(settings: Mapping[str, float | int]) -> dict[str, float | int]:
    """``settings`` (a subset of `TENANT_SETTINGS`) when every value is in range: ``weight``
    finite in (0, 1e6]; ``priority`` a 32-bit integer; the limits non-negative integers (0:
    unlimited; ``max_concurrent`` 32-bit, the per-minute ones 63-bit, what both databases hold).

    Raises:
        InvalidArgumentError: naming the setting and its range.
    """
    out: dict[str, float | int] = {}
    for key, value in settings.items():
        if key not in TENANT_SETTINGS:
            raise InvalidArgumentError(f"unknown tenant setting '{key}' (known: {', '.join(TENANT_SETTINGS)})")
        if key == "weight":
            w = float(value)
            if not math.isfinite(w) or not 0.0 < w <= MAX_WEIGHT:
                raise InvalidArgumentError(f"weight {value} is not a number in (0, {MAX_WEIGHT:g}]")
            out[key] = w
            continue
        lo, hi = _BOUNDS[key]
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            meaning = "0 is the default class, lower is served first" if key == "priority" else "0: unlimited"
            raise InvalidArgumentError(f"{key} {value!r} is not an integer in [{lo}, {hi}] ({meaning})")
        out[key] = int(value)
    return out


@dataclass(frozen=True)
class TenantView:
    """A tenant with its usage, as the admin calls answer."""

    record: TenantRecord
    usage: TenantUsageView


class TenantAdmin:
    """The admin operations over ``store``, refreshing ``book`` (and its directory) after each
    change.

    Errors: `InvalidArgumentError` (bad name, key or setting), `AlreadyExistsError` (name or key
    taken), `NotFoundError` (no such tenant), `DatabaseUnavailableError`.
    """

    def __init__(self, store: AdapterStore, book: QuotaBook) -> None:
        self.store = store
        self.book = book

    def add(self, name: str, settings: Mapping[str, float | int], api_key: str = "") -> tuple[TenantView, str]:
        """Add tenant ``name`` with ``settings`` (others at their defaults) and one API key
        (``api_key``, else a generated one); ``(the tenant, its key in clear)``.

        Raises:
            AlreadyExistsError: the name is taken, or the key is another tenant's or this
                control plane's own ``--api-key`` / admin token.
        """
        check_tenant_name(name, new=True)
        values = check_settings(settings)
        key = check_key(api_key) if api_key else generate_key()
        if self.book.directory.is_server_credential(key):
            raise AlreadyExistsError(
                "this API key is the control plane's --api-key or admin token (they stand for the "
                "tenant 'default'); give another (or none)"
            )
        record = self.store.add_tenant(TenantRecord(name=name, **values), key_hash(key))  # type: ignore[arg-type]
        self.book.refresh()
        return TenantView(record, self.book.usage(name)), key

    def update(self, name: str, settings: Mapping[str, float | int]) -> TenantView:
        """Change some settings of tenant ``name`` (the others keep their value)."""
        check_tenant_name(name)
        record = self.store.update_tenant(name, check_settings(settings))
        if record is None:
            raise self._not_found(name)
        self.book.refresh()
        return TenantView(record, self.book.usage(name))

    def list(self) -> list[TenantView]:
        """Every tenant with its limits and its usage (read from the store now: a fresh sync)."""
        states = self.book.sync(raise_unavailable=True) or []
        return [TenantView(s.record, self.book.usage(s.record.name)) for s in states]

    def remove(self, name: str) -> None:
        """Remove tenant ``name`` and its keys (its requests in flight finish)."""
        check_tenant_name(name)
        if not self.store.remove_tenant(name):
            raise self._not_found(name)
        self.book.refresh()

    def _not_found(self, name: str) -> NotFoundError:
        names = [r.name for r in self.book.directory.records()]
        more = f", … and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
        known = f"tenants: {', '.join(names[:MAX_LISTED])}{more}" if names else "no tenants are configured"
        return NotFoundError(f"tenant '{name}' not found; {known}")
