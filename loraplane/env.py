"""Names of the environment variables loraplane reads (one place for both planes and the CLI)."""

from __future__ import annotations

ENV_ADDR = "LORAPLANE_ADDR"
"""Control-plane address the CLI and clients use when ``--addr`` is not given."""

ENV_ADMIN_TOKEN = "LORAPLANE_ADMIN_TOKEN"
"""Bearer token for admin RPCs (register, unregister, default set)."""

ENV_API_KEY = "LORAPLANE_API_KEY"
"""Bearer key for inference and read calls (Generate, reads, the HTTP API's /v1 routes); the
admin token passes wherever it does. Distinct from the admin token and the worker secret."""

ENV_DEBUG = "LORAPLANE_DEBUG"
"""``1``: the CLI prints tracebacks for unexpected internal errors."""

ENV_NO_PROGRESS = "LORAPLANE_NO_PROGRESS"
"""Non-empty: never draw progress bars, even on a terminal."""
ENV_DATABASE_URL = "LORAPLANE_DATABASE_URL"
"""The control plane's ``--database`` URL (keeps a PostgreSQL password out of ``ps``)."""
ENV_WORKER_SECRET = "LORAPLANE_WORKER_SECRET"
"""Shared secret between the control plane and its workers (worker membership RPCs and every
Worker RPC need it when set). Distinct from the admin token; ``serve`` generates one for its
own worker and hands it over through this variable (never on the command line)."""
ENV_PARENT_FD = "LORAPLANE_PARENT_FD"
"""Set by ``serve`` for its worker: the read end of a pipe whose write end only ``serve``
holds; end of file on it means ``serve`` died, and the worker stops (``worker.rpc.parent``)."""
ENV_WORKER_RESTARTS = "LORAPLANE_WORKER_RESTARTS"
"""Set by ``serve`` for its worker: how many times it started this worker id again before this
process (reported in the worker's hello, so the control plane's ``restarts`` matches serve's log)."""
ENV_ENGINE = "LORAPLANE_ENGINE"
"""``cpu`` or ``gpu``: the worker context's engine (``Model.new_context``); unset, the GPU engine
on a CUDA device and the CPU engine elsewhere."""
ENV_GPU_MM = "LORAPLANE_GPU_MM"
"""``round`` (default) or ``f32``: how the GPU engine's 16-bit matmuls write their output
(``worker.gpu.context.MM_OUTPUT``)."""
