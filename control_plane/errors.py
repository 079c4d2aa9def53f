"""Domain errors of the control plane.

Everything inside `control_plane/` raises these; only the servicer boundary
(`control_plane.servicer`) turns them into gRPC status codes, in one table. Every message
names the thing at fault (adapter id, path, tensor, worker).
"""

from __future__ import annotations


class ControlPlaneError(Exception):
    """Base class: a request the control plane refuses or cannot serve."""


class InvalidArgumentError(ControlPlaneError):
    """The request itself is wrong (bad adapter file, negative scale, malformed upload)."""


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
    """No live worker, or the chosen worker failed."""


def describe_ids(ids: list[int] | tuple[int, ...] | set[int]) -> str:
    """``"registered ids: [0, 2]"`` (or ``"no adapters are registered"``) for NOT_FOUND messages."""
    ordered = sorted(ids)
    return f"registered ids: {ordered}" if ordered else "no adapters are registered"
