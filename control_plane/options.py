"""The control plane's command-line options, beside its config (`control_plane.config`).

Each option's destination is a ``ControlPlaneConfig`` field (``--heartbeat-interval`` →
``heartbeat_interval_s``), except the ``--grammar-max-*`` options and ``--max-tools``, which
fill ``grammar_limits`` (`loraplane.options.GRAMMAR_LIMIT_FIELDS`), and ``--lora`` /
``--lora-scaled``, which the launcher puts back in command-line order first. A new config
field's flag is one entry here and nothing in the CLI: `control_plane_config` passes every
value through by name, and ``serve`` hands the control plane every `CONTROL_PLANE_OPTIONS`
value by the same names (``tests/unit/test_server_options.py`` checks each name is a field).

`CONTROL_PLANE_OPTIONS` are what ``loraplane control-plane`` and ``loraplane serve`` both
take; `STANDALONE_OPTIONS` only a control plane started on its own (``serve`` sets TLS off
and the rank bound from its worker's ``--max-lora-rank``). The launcher
(`clients.cli.server_commands`) lists them in its commands.

Nothing here imports the control plane's machinery (`control_plane.config` imports the
registry and its store): the CLI builds its commands from this module on every start, so
`control_plane_config` imports the config only when a control plane is about to start.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from loraplane.env import ENV_ADMIN_TOKEN, ENV_API_KEY, ENV_DATABASE_URL, ENV_WORKER_SECRET
from loraplane.options import PATH_SCALE, HostPortType, grammar_limits_of, positive_seconds

if TYPE_CHECKING:
    from control_plane.config import ControlPlaneConfig

DEFAULT_DATA_DIR = "./loraplane-data"
"""``--data-dir``'s default (the config's own, ``data``, is for programs that build one)."""

CONTROL_PLANE_OPTIONS = (
    click.Option(
        ["--data-dir"],
        default=DEFAULT_DATA_DIR,
        show_default=True,
        type=click.Path(file_okay=False),
        help="Where the SQLite registry and uploaded adapters live (with "
        "--database postgresql://…: uploads in progress only).",
    ),
    click.Option(
        ["--database"],
        envvar=ENV_DATABASE_URL,
        default=None,
        metavar="URL",
        help="sqlite:///PATH (default: <data-dir>/loraplane.sqlite3) or "
        "postgresql://USER@HOST:PORT/DB, which several control-plane "
        f"replicas may share (env {ENV_DATABASE_URL}).",
        show_envvar=False,
    ),
    click.Option(
        ["--db-pool-size"],
        type=click.IntRange(min=1),
        default=None,
        help="Most PostgreSQL connections this control plane opens (default 10).",
    ),
    click.Option(
        ["--adapter-dir", "adapter_dirs"],
        multiple=True,
        type=click.Path(file_okay=False),
        help="Directory whose files may be registered by server path (repeatable).",
    ),
    click.Option(
        ["--lora", "lora"],
        multiple=True,
        metavar="PATH",
        help="Register this adapter at start-up, default scale 1 (repeatable).",
    ),
    click.Option(
        ["--lora-scaled", "lora_scaled"],
        multiple=True,
        type=PATH_SCALE,
        help="Register this adapter at start-up with default SCALE (repeatable).",
    ),
    click.Option(
        ["--lora-init-without-apply"],
        is_flag=True,
        help="Register the start-up adapters but leave the default set empty.",
    ),
    click.Option(
        ["--admin-token"],
        envvar=ENV_ADMIN_TOKEN,
        default=None,
        metavar="TOKEN",
        help=f"Require this bearer token for admin calls (env {ENV_ADMIN_TOKEN}).",
    ),
    click.Option(
        ["--api-key"],
        envvar=ENV_API_KEY,
        default=None,
        metavar="KEY",
        help=f"Require this bearer key for inference and reads, gRPC and HTTP (env {ENV_API_KEY}); "
        "the admin token passes too; /health and /metrics stay open.",
    ),
    click.Option(
        ["--worker-secret"],
        envvar=ENV_WORKER_SECRET,
        default=None,
        metavar="SECRET",
        help=f"Shared secret workers must present (env {ENV_WORKER_SECRET}); serve "
        "generates one for its own worker when unset.",
    ),
    click.Option(
        ["--max-upload-bytes"],
        type=click.IntRange(min=1),
        default=None,
        help="Largest adapter upload accepted (RESOURCE_EXHAUSTED beyond).",
    ),
    click.Option(
        ["--heartbeat-interval", "heartbeat_interval_s"],
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        metavar="SECONDS",
        help="Worker heartbeat interval.",
    ),
    click.Option(
        ["--max-threads"],
        type=click.IntRange(min=1),
        default=None,
        help="gRPC handler threads (each streaming Generate holds one; default 64).",
    ),
    click.Option(
        ["--max-streams"],
        type=click.IntRange(min=1),
        default=None,
        help="Concurrent Generate streams; more get RESOURCE_EXHAUSTED at once "
        "(default: max-threads - 16, kept for heartbeats, health and reads).",
    ),
    click.Option(
        ["--max-fetches"],
        type=click.IntRange(min=1),
        default=None,
        help="Concurrent FetchAdapter streams (workers pulling adapter bytes); more get "
        "RESOURCE_EXHAUSTED at once (default 4; counts against --max-threads like --max-streams).",
    ),
    click.Option(
        ["--fetch-stall-timeout", "fetch_stall_timeout_s"],
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        metavar="SECONDS",
        help="Cancel a FetchAdapter whose reader accepts no chunk for this long (default 10).",
    ),
    click.Option(
        ["--log-level"],
        type=click.Choice(["debug", "info", "warning", "error"]),
        default=None,
        help="Control-plane log level (default info).",
    ),
    click.Option(
        ["--http-addr"],
        type=HostPortType(),
        default=None,
        metavar="HOST:PORT",
        help="Serve the OpenAI-compatible HTTP API here (default: off; port 0 picks one).",
    ),
    click.Option(
        ["--http-max-connections", "http_max_connections"],
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Open HTTP connections; past it a new one is reset at once (default 1024). From "
        "3/4 of it on, idle connections get --http-head-timeout-busy instead of --http-head-timeout.",
    ),
    click.Option(
        ["--http-max-connections-per-client", "http_max_connections_per_client"],
        type=click.IntRange(min=0),
        default=None,
        metavar="N",
        help="Open HTTP connections per client address (nginx's limit_conn); past it a new one "
        "from that address is reset at once (default 256; 0: no limit; behind a proxy, all its "
        "connections are one client).",
    ),
    click.Option(
        ["--http-head-timeout", "http_head_timeout_s"],
        type=click.FloatRange(min=0, min_open=True),
        callback=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="Close an HTTP connection without a complete request head this long after it "
        "opened or answered its last request (default 30).",
    ),
    click.Option(
        ["--http-head-timeout-busy", "http_head_timeout_busy_s"],
        type=click.FloatRange(min=0, min_open=True),
        callback=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="--http-head-timeout while the open connections are at 3/4 of --http-max-connections "
        "or more, for those already open too: an idle flood is shed in seconds (default 2).",
    ),
    click.Option(
        ["--client-write-timeout", "client_write_timeout_s"],
        type=click.FloatRange(min=0.1),
        default=None,
        metavar="SECONDS",
        help="A client (HTTP or gRPC Generate) that reads nothing for this long while its "
        "response waits to be written, or (HTTP streams) acknowledges none of the bytes owed to "
        "it however much the socket buffers take, counts as gone; its generation is cancelled "
        "(default 30).",
    ),
    click.Option(
        ["--metrics-addr"],
        type=HostPortType(),
        default=None,
        metavar="HOST:PORT",
        help="Serve /health and Prometheus /metrics at http://HOST:PORT, with connections "
        "of their own: probes and scrapers get in while the HTTP API's are full (default: "
        "off; the HTTP API serves both too).",
    ),
    click.Option(
        ["--chat-template"],
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        metavar="FILE",
        help="jinja2 chat template overriding the model's.",
    ),
    click.Option(
        ["--served-model-name"],
        default=None,
        metavar="NAME",
        help="The base model's name on the HTTP API (default: the GGUF file's stem).",
    ),
    click.Option(
        ["--metrics-max-adapters"],
        type=click.IntRange(min=0),
        default=None,
        help="Distinct adapter label values in metrics before the rest fold into 'other' (default 64).",
    ),
    click.Option(
        ["--http-max-body-bytes"],
        type=click.IntRange(min=1),
        default=None,
        help="Largest HTTP request body; larger ones get 413 before they are read (default 16777216 = 16 MiB).",
    ),
    click.Option(
        ["--max-tools"],
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Most entries in a chat request's 'tools' (default 128, as OpenAI's API).",
    ),
    click.Option(
        ["--grammar-check-processes"],
        type=click.IntRange(min=1),
        default=None,
        help="Child processes that compile structured-output formats before routing, so a "
        "format that crashes the grammar engine costs one child, not the server (default 2).",
    ),
    click.Option(
        ["--grammar-check-timeout", "grammar_check_timeout_s"],
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        metavar="SECONDS",
        help="A structured-output format that takes longer to compile is refused with 400 / "
        "INVALID_ARGUMENT and its child process killed (default 10).",
    ),
    click.Option(
        ["--http-max-prompt-bytes"],
        type=click.IntRange(min=1),
        default=None,
        help="Largest HTTP text prompt / chat content in UTF-8 bytes, refused with 400 before "
        "tokenizing (default: what n_ctx tokens can cover, the gRPC path's rule).",
    ),
)
"""Options of the control plane, in ``--help`` order: ``loraplane control-plane`` and
``loraplane serve`` take them all."""

STANDALONE_OPTIONS = (
    click.Option(
        ["--tls-cert"],
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="PEM certificate: serve TLS (with --tls-key).",
    ),
    click.Option(
        ["--tls-key"], type=click.Path(exists=True, dir_okay=False), default=None, help="PEM private key of --tls-cert."
    ),
    click.Option(
        ["--max-lora-rank"],
        type=click.IntRange(min=1),
        default=None,
        help="Refuse registering adapters above this rank (the workers' --max-lora-rank; default 64).",
    ),
    click.Option(
        ["--insecure-workers"],
        is_flag=True,
        help="Without --worker-secret, let anyone who reaches this port join as a worker and "
        "download adapter bytes (trusted networks only). Default: worker RPCs are refused "
        "until a secret is set.",
    ),
)
"""Options of a control plane started on its own (``loraplane control-plane``), after
``--model``."""


def control_plane_config(values: Mapping[str, Any], *, adapters: Sequence[tuple[str, float]]) -> ControlPlaneConfig:
    """The ``ControlPlaneConfig`` of a control-plane command's option values (by option name,
    ``addr`` included): the ``--grammar-max-*`` and ``--max-tools`` values become one
    ``GrammarLimits``, ``--adapter-dir`` paths absolute; a value that is None keeps the field's
    default.

    Args:
        values: option values; ``lora`` / ``lora_scaled`` among them are ignored.
        adapters: the start-up adapters as ``(path, scale)`` in registration order; all go to
            ``lora_scaled`` (``--lora PATH`` is ``PATH:1.0``), which keeps that order.

    Raises:
        TypeError: a name that is no ``ControlPlaneConfig`` field (an option added without its
            field).
    """
    from control_plane.config import ControlPlaneConfig

    fields = {k: v for k, v in values.items() if k not in ("lora", "lora_scaled")}
    fields["grammar_limits"] = grammar_limits_of(fields)
    if "data_dir" in fields:
        fields["data_dir"] = str(fields["data_dir"])
    if "adapter_dirs" in fields:
        fields["adapter_dirs"] = tuple(str(Path(d).resolve()) for d in fields["adapter_dirs"])
    for secret in ("admin_token", "worker_secret"):
        if secret in fields:
            fields[secret] = fields[secret] or None
    present = {k: v for k, v in fields.items() if v is not None}
    return ControlPlaneConfig(lora=(), lora_scaled=tuple(adapters), **present)
