"""Domain errors of the worker, one class per outcome (like ``control_plane.errors``).

Everything under ``worker/`` raises these (or lets a lower-level error such as
``AdapterError`` be wrapped into one); only the gRPC edge (``worker.rpc.status``) maps them to
status codes, in one table keyed by class, so a new or misspelled outcome cannot silently
become INTERNAL: a class missing from the table fails the table's test. Every message names
the thing at fault (request, adapter id, token, path).
"""

from __future__ import annotations


class WorkerError(Exception):
    """Base class: a request or call the worker refuses or cannot serve."""


class InvalidRequestError(WorkerError):
    """The request itself is wrong: empty/too long prompt, token id out of range, bad scale,
    two aLoRAs, an adapter file that fails validation, a sha256 mismatch."""


class AdapterNotFoundError(WorkerError):
    """An adapter id or file the worker does not hold. Messages list what it holds."""


class AdapterConflictError(WorkerError):
    """An adapter id already loaded with other content."""


class QueueFullError(WorkerError):
    """Every slot is busy and the waiting queue is at ``--queue-limit``."""


class DrainTimeoutError(WorkerError):
    """An unload waited longer than allowed for running requests to finish."""


class PermissionDeniedError(WorkerError):
    """A server-side path outside the worker's adapter directories."""


class UnauthenticatedError(WorkerError):
    """A call without the control plane's credential."""


class WorkerDrainingError(WorkerError):
    """The worker is shutting down (SIGTERM): it finishes what it runs and admits nothing new,
    so the control plane retries the request on another worker."""


class DecodeFailedError(WorkerError):
    """The forward pass failed for a request already admitted (an internal fault)."""


class AdapterFetchError(WorkerError):
    """An adapter's bytes could not be fetched from the control plane: missing there
    (``not_found``) or not hashing to the registered sha256. The request fails; no slot is
    taken."""

    def __init__(self, message: str, *, not_found: bool = False, adapter_id: int | None = None):
        super().__init__(message)
        self.not_found = not_found
        self.adapter_id = adapter_id
        """The adapter whose local copy failed to re-read (page-in), when known."""
