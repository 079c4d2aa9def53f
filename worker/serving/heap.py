"""Give freed heap memory back to the OS after adapter loads (glibc ``malloc_trim``).

Validating, fetching and reading ahead an adapter allocate and free a few MiB of short-lived
buffers on whichever gRPC thread submitted the request; glibc keeps freed chunks in that
thread's arena, so a worker that pages through many adapters sees RSS creep up with the
number of distinct adapters served although nothing is retained. ``malloc_trim(0)`` returns
the free pages of every arena (``madvise(MADV_DONTNEED)``); it costs well under a millisecond
and runs only after something was loaded. A no-op where the C library has no ``malloc_trim``
(musl, macOS, Windows).
"""

from __future__ import annotations

import ctypes
import ctypes.util

_trim = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = getattr(_libc, "malloc_trim", None)
except OSError:  # no C library to load: nothing to trim
    _trim = None


def release_free_heap() -> bool:
    """Return freed heap pages to the OS; True when the C library supports it."""
    if _trim is None:
        return False
    _trim(0)
    return True


__all__ = ["release_free_heap"]
