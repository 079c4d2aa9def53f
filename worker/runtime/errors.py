"""Errors of the runtime layer (model loading, architectures), below the worker's error table.

``worker.errors`` holds the outcomes the gRPC edge maps to status codes; the runtime raises
these lower-level errors and the serving layer wraps them. Kept in a module of their own so the
architecture builders (``worker.runtime.arch``) and the loader (``worker.runtime.model``) can
both raise them without importing each other.
"""

from __future__ import annotations


class ModelError(ValueError):
    """The base model cannot be loaded (unknown architecture, missing tensor or metadata key,
    bad shape, a device that is not there). Messages name the file and the thing at fault."""


__all__ = ["ModelError"]
