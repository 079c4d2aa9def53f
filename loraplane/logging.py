"""structlog set-up for the control plane: one JSON object per line on stderr.

Request ids travel in structlog's context variables (`bind_request`), so every line logged
while a request is handled carries ``request_id``. `configure_logging` is idempotent: the
first call wins, later calls (a second server in the same process, tests) do nothing.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

_configured = False
_lock = threading.Lock()


def configure_logging(level: str = "info") -> None:
    """Route structlog to stderr as JSON lines with a timestamp, level and context vars."""
    global _configured
    with _lock:
        if _configured:
            return
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=True,
        )
        _configured = True


@contextmanager
def bind_request(**fields: object) -> Iterator[None]:
    """Bind ``fields`` (e.g. ``request_id``, ``method``) to every log line in this block."""
    with structlog.contextvars.bound_contextvars(**fields):
        yield
