"""Domain errors of the control plane.

Everything inside `control_plane/` raises these; only the edges, the gRPC servicer
(`control_plane.servicer`) and the HTTP front (`control_plane.http.errors`), turn them into
codes, both from one table (`control_plane.error_codes`). Every message names the thing at
fault (adapter id, path, tensor, worker).
"""

from __future__ import annotations

from typing import Any

MAX_ECHO_CHARS = 256
"""Characters of client-given text (a model id, an adapter or tenant name) an error message
repeats; longer text is cut and ends with "…", so a 100 KB model id is not sent back whole."""


def echo(text: str) -> str:
    """``text`` for an error message: whole up to `MAX_ECHO_CHARS` characters, else its start
    and "…" (`MAX_ECHO_CHARS` characters in all)."""
    return text if len(text) <= MAX_ECHO_CHARS else text[: MAX_ECHO_CHARS - 1] + "…"


class ControlPlaneError(Exception):
    """Base class: a request the control plane refuses or cannot serve."""


class InvalidArgumentError(ControlPlaneError):
    """The request itself is wrong (bad adapter file, negative scale, malformed upload)."""


class AmbiguousNameError(InvalidArgumentError):
    """An adapter name (or alias) that several adapters answer to (names are metadata, not
    keys: files may embed the same ``general.name``). The message lists their ids; gRPC
    INVALID_ARGUMENT, HTTP 400, as vLLM answers a request it cannot act on."""


class AlreadyExistsError(ControlPlaneError):
    """A name asked for at registration that an adapter already answers to (gRPC
    ALREADY_EXISTS; HTTP 400 with vLLM's "has already been loaded" message)."""


class NotFoundError(ControlPlaneError):
    """An adapter id, worker or file that does not exist. Messages list what does exist."""


class PermissionDeniedError(ControlPlaneError):
    """A server-side path outside every configured adapter directory; a worker id taken over
    from another address without the worker secret."""


class ResourceExhaustedError(ControlPlaneError):
    """An upload over the size limit; every worker full; too many pending worker joins."""


class UnauthenticatedError(ControlPlaneError):
    """An admin call without the right bearer token."""


class UnavailableError(ControlPlaneError):
    """No live worker, the chosen worker failed, or the database is unreachable; the client
    may retry (gRPC UNAVAILABLE; HTTP 503 with ``Retry-After: retry_after_s``)."""

    retry_after_s: int = 1


class DatabaseUnavailableError(UnavailableError):
    """The control plane's database (`control_plane.store`) could not be reached or did not
    answer within its bounded timeouts (connect, pool wait, statement: 2 s each).

    The message names the database without credentials and the reason, e.g.
    ``database unavailable (postgresql://lp@db:5432/lp: connection refused); retry later``.
    """

    retry_after_s: int = 2

    def __init__(self, database: str, reason: str) -> None:
        super().__init__(f"database unavailable ({database}: {reason}); retry later")
        self.database = database
        self.reason = reason


class DataCorruptionError(ControlPlaneError):
    """A stored record that cannot be read: a database row whose columns do not parse
    (e.g. an adapter's ``metadata`` that is not a JSON object). Listing and routing skip such
    a row; asking for it by id raises this (gRPC DATA_LOSS, HTTP 500) naming the row."""


MAX_LISTED = 16
"""Items of a list (served names, registered ids, tenants) an error message spells out; the
rest are counted. With thousands of adapters, a 404 for an unknown model listed every name:
half a megabyte answered to a 60-byte request from anyone, and 50 ms of the control plane."""


def listing(items: list[Any] | tuple[Any, ...]) -> str:
    """``items`` as an error message shows them: ``['a', 'b']`` (their reprs, as a list prints)
    up to `MAX_LISTED` items, else the first `MAX_LISTED` and ``… and N more]``."""
    if len(items) <= MAX_LISTED:
        return repr(list(items))
    shown = ", ".join(repr(x) for x in items[:MAX_LISTED])
    return f"[{shown}, … and {len(items) - MAX_LISTED} more]"


def describe_ids(ids: list[int] | tuple[int, ...] | set[int]) -> str:
    """``"registered ids: [0, 2]"`` (or ``"no adapters are registered"``) for NOT_FOUND messages
    (`listing`: the first `MAX_LISTED`)."""
    ordered = sorted(ids)
    return f"registered ids: {listing(ordered)}" if ordered else "no adapters are registered"
