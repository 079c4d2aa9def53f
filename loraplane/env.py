"""Names of the environment variables loraplane reads (one place for both planes and the CLI)."""

from __future__ import annotations

ENV_ADDR = "LORAPLANE_ADDR"
"""Control-plane address the CLI and clients use when ``--addr`` is not given."""

ENV_ADMIN_TOKEN = "LORAPLANE_ADMIN_TOKEN"
"""Bearer token for admin RPCs (register, unregister, default set)."""

ENV_DEBUG = "LORAPLANE_DEBUG"
"""``1``: the CLI prints tracebacks for unexpected internal errors."""

ENV_DATABASE_URL = "LORAPLANE_DATABASE_URL"
"""The control plane's ``--database`` URL (keeps a PostgreSQL password out of ``ps``)."""
