"""Server commands of the ``loraplane`` CLI: ``control-plane``, ``worker`` and ``serve``.

The servers themselves live in ``control_plane.server`` and ``worker.rpc.server``; they are
imported inside the commands so that the CLI starts fast (no torch import for client
commands or ``--help``).

Start-up adapters register in command-line order across ``--lora`` and ``--lora-scaled``
("in the order given", as llama-server). click collects each option into its
own list, so `OrderedArgsCommand` keeps the raw arguments and `startup_adapters` restores the
interleaving; the control plane then gets them all in ``lora_scaled`` (``--lora PATH`` is
``PATH:1.0``) and an empty ``lora`` list, which keeps that order whatever it does with the two.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from clients.params import DEVICE, ENV_ADMIN_TOKEN, ENV_API_KEY, PATH_SCALE, HostPortListType, HostPortType
from loraplane.compute_spec import DEVICE_METAVAR, DTYPE_NAMES
from loraplane.env import ENV_DATABASE_URL, ENV_WORKER_SECRET

F = TypeVar("F", bound=Callable[..., Any])
RAW_ARGS_KEY = "loraplane.raw_args"
DEFAULT_DATA_DIR = "./loraplane-data"


class OrderedArgsCommand(click.Command):
    """A command that keeps its raw arguments in ``ctx.meta`` (see `startup_adapters`)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[RAW_ARGS_KEY] = list(args)
        return super().parse_args(ctx, args)


def startup_adapters(
    raw_args: Sequence[str], lora: Sequence[str], lora_scaled: Sequence[tuple[str, float]]
) -> list[tuple[str, float]]:
    """``--lora`` / ``--lora-scaled`` values as ``(path, scale)`` in command-line order."""
    kinds: list[str] = []
    for arg in raw_args:
        if arg == "--":
            break
        if arg == "--lora" or arg.startswith("--lora="):
            kinds.append("lora")
        elif arg == "--lora-scaled" or arg.startswith("--lora-scaled="):
            kinds.append("scaled")
    plain = [(path, 1.0) for path in lora]
    scaled = list(lora_scaled)
    if kinds.count("lora") != len(plain) or kinds.count("scaled") != len(scaled):
        return plain + scaled  # could not line the values up with the arguments
    ordered = []
    for kind in kinds:
        ordered.append(plain.pop(0) if kind == "lora" else scaled.pop(0))
    return ordered


def _existing_file(path: str, flag: str) -> str:
    """``path`` made absolute: an adapter GGUF file or a PEFT folder (holding adapter_config.json,
    converted by the control plane at start-up)."""
    peft = os.path.isdir(path) and os.path.isfile(os.path.join(path, "adapter_config.json"))
    if not os.path.isfile(path) and not peft:
        raise click.BadParameter(
            f"file {path!r} does not exist (nor is it a PEFT folder with adapter_config.json)", param_hint=flag
        )
    return os.path.abspath(path)


def make_config(cls: type, **values: Any) -> Any:
    """``cls(**values)`` keeping only the fields ``cls`` has; warn about set values it lacks."""
    accepted = inspect.signature(cls).parameters
    unknown = [k for k, v in values.items() if k not in accepted and v not in (None, [], (), False)]
    for key in unknown:
        click.echo(f"loraplane: warning: {cls.__name__} has no field {key!r}; ignored", err=True)
    return cls(**{k: v for k, v in values.items() if k in accepted})


# ---- option groups -----------------------------------------------------------------------


def control_plane_options(f: F) -> F:
    options = [
        click.option(
            "--data-dir",
            default=DEFAULT_DATA_DIR,
            show_default=True,
            type=click.Path(file_okay=False),
            help="Where the SQLite registry and uploaded adapters live (with "
            "--database postgresql://…: uploads in progress only).",
        ),
        click.option(
            "--database",
            envvar=ENV_DATABASE_URL,
            default=None,
            metavar="URL",
            help="sqlite:///PATH (default: <data-dir>/loraplane.sqlite3) or "
            "postgresql://USER@HOST:PORT/DB, which several control-plane "
            f"replicas may share (env {ENV_DATABASE_URL}).",
            show_envvar=False,
        ),
        click.option(
            "--db-pool-size",
            type=click.IntRange(min=1),
            default=None,
            help="Most PostgreSQL connections this control plane opens (default 10).",
        ),
        click.option(
            "--adapter-dir",
            "adapter_dirs",
            multiple=True,
            type=click.Path(file_okay=False),
            help="Directory whose files may be registered by server path (repeatable).",
        ),
        click.option(
            "--lora",
            "lora",
            multiple=True,
            metavar="PATH",
            help="Register this adapter at start-up, default scale 1 (repeatable).",
        ),
        click.option(
            "--lora-scaled",
            "lora_scaled",
            multiple=True,
            type=PATH_SCALE,
            help="Register this adapter at start-up with default SCALE (repeatable).",
        ),
        click.option(
            "--lora-init-without-apply",
            is_flag=True,
            help="Register the start-up adapters but leave the default set empty.",
        ),
        click.option(
            "--admin-token",
            envvar=ENV_ADMIN_TOKEN,
            default=None,
            metavar="TOKEN",
            help=f"Require this bearer token for admin calls (env {ENV_ADMIN_TOKEN}).",
        ),
        click.option(
            "--api-key",
            envvar=ENV_API_KEY,
            default=None,
            metavar="KEY",
            help=f"Require this bearer key for inference and reads, gRPC and HTTP (env {ENV_API_KEY}); "
            "the admin token passes too; /health and /metrics stay open.",
        ),
        click.option(
            "--worker-secret",
            envvar=ENV_WORKER_SECRET,
            default=None,
            metavar="SECRET",
            help=f"Shared secret workers must present (env {ENV_WORKER_SECRET}); serve "
            "generates one for its own worker when unset.",
        ),
        click.option(
            "--max-upload-bytes",
            type=click.IntRange(min=1),
            default=None,
            help="Largest adapter upload accepted (RESOURCE_EXHAUSTED beyond).",
        ),
        click.option(
            "--heartbeat-interval",
            "heartbeat_interval_s",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            metavar="SECONDS",
            help="Worker heartbeat interval.",
        ),
        click.option(
            "--max-threads",
            type=click.IntRange(min=1),
            default=None,
            help="gRPC handler threads (each streaming Generate holds one; default 64).",
        ),
        click.option(
            "--max-streams",
            type=click.IntRange(min=1),
            default=None,
            help="Concurrent Generate streams; more get RESOURCE_EXHAUSTED at once "
            "(default: max-threads - 16, kept for heartbeats, health and reads).",
        ),
        click.option(
            "--max-fetches",
            type=click.IntRange(min=1),
            default=None,
            help="Concurrent FetchAdapter streams (workers pulling adapter bytes); more get "
            "RESOURCE_EXHAUSTED at once (default 4; counts against --max-threads like --max-streams).",
        ),
        click.option(
            "--fetch-stall-timeout",
            "fetch_stall_timeout_s",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            metavar="SECONDS",
            help="Cancel a FetchAdapter whose reader accepts no chunk for this long (default 10).",
        ),
        click.option(
            "--log-level",
            type=click.Choice(["debug", "info", "warning", "error"]),
            default=None,
            help="Control-plane log level (default info).",
        ),
        click.option(
            "--http-addr",
            type=HostPortType(),
            default=None,
            metavar="HOST:PORT",
            help="Serve the OpenAI-compatible HTTP API here (default: off; port 0 picks one).",
        ),
        click.option(
            "--http-max-connections",
            "http_max_connections",
            type=click.IntRange(min=1),
            default=None,
            metavar="N",
            help="Open HTTP connections; past it a new one is reset at once (default 1024). From "
            "3/4 of it on, idle connections get --http-head-timeout-busy instead of --http-head-timeout.",
        ),
        click.option(
            "--http-max-connections-per-client",
            "http_max_connections_per_client",
            type=click.IntRange(min=0),
            default=None,
            metavar="N",
            help="Open HTTP connections per client address (nginx's limit_conn); past it a new one "
            "from that address is reset at once (default 256; 0: no limit; behind a proxy, all its "
            "connections are one client).",
        ),
        click.option(
            "--http-head-timeout",
            "http_head_timeout_s",
            type=click.FloatRange(min=0, min_open=True),
            callback=_positive_seconds,
            default=None,
            metavar="SECONDS",
            help="Close an HTTP connection without a complete request head this long after it "
            "opened or answered its last request (default 30).",
        ),
        click.option(
            "--http-head-timeout-busy",
            "http_head_timeout_busy_s",
            type=click.FloatRange(min=0, min_open=True),
            callback=_positive_seconds,
            default=None,
            metavar="SECONDS",
            help="--http-head-timeout while the open connections are at 3/4 of --http-max-connections "
            "or more, for those already open too: an idle flood is shed in seconds (default 2).",
        ),
        click.option(
            "--client-write-timeout",
            "client_write_timeout_s",
            type=click.FloatRange(min=0.1),
            default=None,
            metavar="SECONDS",
            help="A client (HTTP or gRPC Generate) that reads nothing for this long while its "
            "response waits to be written, or (HTTP streams) acknowledges none of the bytes owed to "
            "it however much the socket buffers take, counts as gone; its generation is cancelled "
            "(default 30).",
        ),
        click.option(
            "--metrics-addr",
            type=HostPortType(),
            default=None,
            metavar="HOST:PORT",
            help="Serve /health and Prometheus /metrics at http://HOST:PORT, with connections "
            "of their own: probes and scrapers get in while the HTTP API's are full (default: "
            "off; the HTTP API serves both too).",
        ),
        click.option(
            "--chat-template",
            type=click.Path(exists=True, dir_okay=False),
            default=None,
            metavar="FILE",
            help="jinja2 chat template overriding the model's.",
        ),
        click.option(
            "--served-model-name",
            default=None,
            metavar="NAME",
            help="The base model's name on the HTTP API (default: the GGUF file's stem).",
        ),
        click.option(
            "--metrics-max-adapters",
            type=click.IntRange(min=0),
            default=None,
            help="Distinct adapter label values in metrics before the rest fold into 'other' (default 64).",
        ),
        click.option(
            "--http-max-body-bytes",
            type=click.IntRange(min=1),
            default=None,
            help="Largest HTTP request body; larger ones get 413 before they are read (default 16777216 = 16 MiB).",
        ),
        click.option(
            "--max-tools",
            type=click.IntRange(min=1),
            default=None,
            metavar="N",
            help="Most entries in a chat request's 'tools' (default 128, as OpenAI's API).",
        ),
        click.option(
            "--grammar-check-processes",
            type=click.IntRange(min=1),
            default=None,
            help="Child processes that compile structured-output formats before routing, so a "
            "format that crashes the grammar engine costs one child, not the server (default 2).",
        ),
        click.option(
            "--grammar-check-timeout",
            "grammar_check_timeout_s",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            metavar="SECONDS",
            help="A structured-output format that takes longer to compile is refused with 400 / "
            "INVALID_ARGUMENT and its child process killed (default 10).",
        ),
        click.option(
            "--http-max-prompt-bytes",
            type=click.IntRange(min=1),
            default=None,
            help="Largest HTTP text prompt / chat content in UTF-8 bytes, refused with 400 before "
            "tokenizing (default: what n_ctx tokens can cover, the gRPC path's rule).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


CP_TUNING = (
    "database",
    "db_pool_size",
    "max_upload_bytes",
    "heartbeat_interval_s",
    "max_threads",
    "max_streams",
    "max_fetches",
    "fetch_stall_timeout_s",
    "log_level",
    "http_addr",
    "client_write_timeout_s",
    "http_max_connections",
    "http_max_connections_per_client",
    "http_head_timeout_s",
    "http_head_timeout_busy_s",
    "metrics_addr",
    "chat_template",
    "served_model_name",
    "metrics_max_adapters",
    "http_max_body_bytes",
    "http_max_prompt_bytes",
    "api_key",
    "grammar_check_processes",
    "grammar_check_timeout_s",
    "max_tools",
)


def _positive_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A duration: a finite number of seconds > 0 (click's FloatRange lets inf and nan through)."""
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise click.BadParameter(f"{value} is not a finite number of seconds > 0", ctx=ctx, param=param)
    return value


def _positive_weight(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A fairness weight: a finite number > 0 (click's FloatRange lets inf and nan through)."""
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise click.BadParameter(f"{value} is not a finite number > 0", ctx=ctx, param=param)
    return value


def model_option(f: F) -> F:
    return click.option(
        "--model",
        "model_path",
        default=None,
        metavar="PATH",
        help="Base model GGUF (default: the embedded Gemma 3 270M).",
    )(f)


FAIRNESS_OPTIONS = [
    click.option(
        "--fairness",
        type=click.Choice(["off", "vtc"]),
        default=None,
        help="Admission order across tenants: off = first come, first served (resident "
        "adapters first, bounded bypass); vtc = Virtual Token Counter fair share per tenant, "
        "weighted, strict priority classes, and the queue's places shared between tenants: a "
        "lighter tenant's request takes a heavier one's newest queued place (docs/fairness.md). "
        "Default off.",
    ),
    click.option(
        "--fairness-prompt-weight",
        type=float,
        default=None,
        callback=_positive_weight,
        metavar="W",
        help="VTC: virtual tokens charged per prompt token (finite, > 0; default 1).",
    ),
    click.option(
        "--fairness-output-weight",
        type=float,
        default=None,
        callback=_positive_weight,
        metavar="W",
        help="VTC: virtual tokens charged per generated token (finite, > 0; default 2).",
    ),
]
"""Fair admission (``worker.serving.fairness``): part of `worker_runtime_options`."""


ENV_GRAMMAR_WARMUP = "LORAPLANE_GRAMMAR_WARMUP"
"""``0`` / ``false``: workers skip the grammar warm-up unless ``--grammar-warmup`` is given."""

GRAMMAR_LIMIT_OPTIONS = [
    click.option(
        "--grammar-max-bytes",
        type=click.IntRange(min=1),
        default=None,
        metavar="BYTES",
        help="Largest structured-output schema / regex / grammar text, and guided_choice list "
        "(default 262144); larger is refused with 400 / INVALID_ARGUMENT.",
    ),
    click.option(
        "--grammar-max-depth",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Longest chain of nested schemas through $refs, or of grammar rule references, in a "
        "structured-output format (default 128).",
    ),
    click.option(
        "--grammar-max-rules",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Most $defs of a JSON Schema, rules of a Lark or GBNF grammar (default 1024).",
    ),
    click.option(
        "--grammar-max-choices",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Most strings in a guided_choice list (default 1024).",
    ),
]
"""Bounds on structured output (``loraplane.grammar_limits.GrammarLimits``): the control
plane's, the worker's (`worker_runtime_options`; ``serve`` gives both the same). The control
plane's ``--max-tools`` completes them (`control_plane_options`)."""

GRAMMAR_LIMIT_FIELDS = {
    "grammar_max_bytes": "max_bytes",
    "grammar_max_depth": "max_depth",
    "grammar_max_rules": "max_rules",
    "grammar_max_choices": "max_choices",
    "max_tools": "max_tools",
}


def grammar_limits_of(values: dict[str, Any]) -> Any:
    """The ``GrammarLimits`` of the `GRAMMAR_LIMIT_OPTIONS` in ``values`` (removed from it);
    None when none was given (the config's default)."""
    from loraplane.grammar_limits import GrammarLimits

    given = {field: values.pop(flag) for flag, field in GRAMMAR_LIMIT_FIELDS.items() if flag in values}
    given = {k: v for k, v in given.items() if v is not None}
    return GrammarLimits(**given) if given else None


def grammar_limit_options(f: F) -> F:
    for option in reversed(GRAMMAR_LIMIT_OPTIONS):
        f = option(f)
    return f


def worker_runtime_options(f: F) -> F:
    """Worker options that ``serve`` forwards to its worker subprocess."""
    options = [
        click.option(
            "--slots",
            "n_slots",
            type=click.IntRange(min=1),
            default=4,
            show_default=True,
            help="Parallel sequences (llama-server --parallel).",
        ),
        click.option(
            "--batching",
            type=click.Choice(["mixed", "compat"]),
            default="mixed",
            show_default=True,
            help="mixed: different adapter sets share a batch; compat: llama.cpp's rule.",
        ),
        click.option(
            "--prefix-cache",
            type=click.Choice(["keyed", "llama"]),
            default="keyed",
            show_default=True,
            help="keyed: per adapter-set prefixes; llama: llama.cpp's clear-on-switch.",
        ),
        click.option(
            "--dtype",
            type=click.Choice(DTYPE_NAMES),
            default="f32",
            show_default=True,
            help="Compute (activation) dtype; on CPU f32 is the exact kernels' path; f16 is refused for "
            "Gemma 2/3 (their activations overflow it: use bf16).",
        ),
        click.option(
            "--weights",
            "weight_form",
            type=click.Choice(["packed", "dequant"]),
            default="packed",
            show_default=True,
            help="packed: GGUF-quantized matrices multiplied in place by our kernels; "
            "dequant: the f32/bf16 dequantized reference (slower, 4x the memory).",
        ),
        click.option(
            "--device",
            type=DEVICE,
            metavar=DEVICE_METAVAR,
            default="auto",
            show_default=True,
            help="auto: the current CUDA device when present, else the CPU; cuda: the current "
            "CUDA device; cuda:N: GPU N (cpu:0 is the CPU too).",
        ),
        click.option(
            "--n-ctx", "n_ctx_slot", type=click.IntRange(min=16), default=None, help="KV cache tokens per slot."
        ),
        click.option(
            "--queue-limit",
            type=click.IntRange(min=0),
            default=None,
            help="Waiting requests beyond the slots before RESOURCE_EXHAUSTED.",
        ),
        click.option(
            "--prefix-cache-tokens",
            type=click.IntRange(min=0),
            default=None,
            help="Token budget of the keyed prefix cache.",
        ),
        click.option(
            "--max-loras",
            type=click.IntRange(min=1),
            default=None,
            help="Adapter slots in the worker's device pool (default 16); a request may "
            "use at most this many adapters.",
        ),
        click.option(
            "--max-cpu-loras",
            type=click.IntRange(min=1),
            default=None,
            help="Adapters kept validated on the host, ready to page in (default 128), LRU "
            "beyond it; their bytes stay in local files read at page-in, not in worker memory.",
        ),
        click.option(
            "--max-lora-rank",
            type=click.IntRange(min=1),
            default=None,
            help="Largest adapter rank a worker accepts (default 64).",
        ),
        click.option(
            "--drain-timeout",
            "drain_timeout_s",
            type=click.FloatRange(min=0),
            default=None,
            metavar="SECONDS",
            help="On SIGTERM the worker admits nothing new and lets in-flight generations finish "
            "for up to this long, then exits; a second signal stops at once. Whatever happens, the "
            "process is gone 5 s after this (default 45; keep it + 5 below the Kubernetes "
            "manifests' terminationGracePeriodSeconds of 60).",
        ),
        *FAIRNESS_OPTIONS,
        *GRAMMAR_LIMIT_OPTIONS,
        click.option(
            "--grammar-warmup/--no-grammar-warmup",
            envvar=ENV_GRAMMAR_WARMUP,
            default=None,
            help="Build the grammar engine's view of the vocabulary at start-up, before "
            "registering (default), or at the first structured-output request (several seconds "
            f"of one core; for tests that start many workers; env {ENV_GRAMMAR_WARMUP}=0).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def worker_args(
    *,
    model_path: str | None,
    n_slots: int,
    batching: str,
    prefix_cache: str,
    dtype: str,
    device: str,
    n_ctx_slot: int | None,
    queue_limit: int | None,
    prefix_cache_tokens: int | None,
    weight_form: str = "packed",
    metrics_max_adapters: int | None = None,
    metrics_addr: str | None = None,
    max_loras: int | None = None,
    max_cpu_loras: int | None = None,
    max_lora_rank: int | None = None,
    drain_timeout_s: float | None = None,
    fairness: str | None = None,
    fairness_prompt_weight: float | None = None,
    fairness_output_weight: float | None = None,
    grammar_warmup: bool | None = None,
    **grammar_limits: int | None,
) -> tuple[str, ...]:
    """The ``loraplane worker`` arguments for `worker_runtime_options` values
    (``grammar_limits``: the `GRAMMAR_LIMIT_OPTIONS`, by parameter name)."""
    args = [
        "--slots",
        str(n_slots),
        "--batching",
        batching,
        "--prefix-cache",
        prefix_cache,
        "--dtype",
        dtype,
        "--weights",
        weight_form,
        "--device",
        device,
    ]
    optional: dict[str, str | int | float | None] = {
        "--model": model_path,
        "--n-ctx": n_ctx_slot,
        "--queue-limit": queue_limit,
        "--prefix-cache-tokens": prefix_cache_tokens,
        "--metrics-max-adapters": metrics_max_adapters,
        "--metrics-addr": metrics_addr,
        "--max-loras": max_loras,
        "--max-cpu-loras": max_cpu_loras,
        "--max-lora-rank": max_lora_rank,
        "--drain-timeout": drain_timeout_s,
        "--fairness": fairness,
        "--fairness-prompt-weight": fairness_prompt_weight,
        "--fairness-output-weight": fairness_output_weight,
    }
    for name, bound in grammar_limits.items():
        if name not in GRAMMAR_LIMIT_FIELDS:
            raise TypeError(f"worker_args() got an unexpected keyword argument {name!r}")
        optional["--" + name.replace("_", "-")] = bound
    for flag, value in optional.items():
        if value is not None:
            args += [flag, str(value)]
    if grammar_warmup is not None:
        args.append("--grammar-warmup" if grammar_warmup else "--no-grammar-warmup")
    return tuple(args)


# ---- loading the servers -----------------------------------------------------------------


def worker_default_n_ctx() -> int:
    """The worker's ``--n-ctx`` default (``WorkerConfig.n_ctx_seq``), without importing torch."""
    from worker.config import WorkerConfig

    return int(WorkerConfig.n_ctx_seq)


def load_control_plane() -> tuple[Callable[..., Any], type]:
    try:
        from control_plane.server import ControlPlaneConfig, run_control_plane
    except ImportError as err:
        raise click.ClickException(f"the control plane is not available: {err}") from None
    return run_control_plane, ControlPlaneConfig


def control_plane_config(
    cls: type,
    *,
    addr: str,
    data_dir: str,
    adapter_dirs: Sequence[str],
    model_path: str | None,
    adapters: Sequence[tuple[str, float]],
    lora_init_without_apply: bool,
    admin_token: str | None,
    worker_secret: str | None = None,
    **tuning: Any,
) -> Any:
    """``ControlPlaneConfig``; ``tuning`` values that are None keep the config's defaults."""
    return make_config(
        cls,
        addr=addr,
        data_dir=str(data_dir),
        adapter_dirs=tuple(str(Path(d).resolve()) for d in adapter_dirs),
        model_path=model_path,
        lora=(),
        lora_scaled=tuple(adapters),
        lora_init_without_apply=lora_init_without_apply,
        admin_token=admin_token or None,
        worker_secret=worker_secret or None,
        **{k: v for k, v in tuning.items() if v is not None},
    )


def _startup_adapters_from(
    ctx: click.Context, lora: Sequence[str], lora_scaled: Sequence[tuple[str, float]]
) -> list[tuple[str, float]]:
    ordered = startup_adapters(ctx.meta.get(RAW_ARGS_KEY, ()), lora, lora_scaled)
    return [(_existing_file(p, "--lora/--lora-scaled"), s) for p, s in ordered]


def _run_blocking(what: str, fn: Callable[[], Any]) -> int:
    """Run a blocking server function; Ctrl-C is a clean stop, other failures exit 1."""
    try:
        fn()
    except KeyboardInterrupt:
        return 0
    except (OSError, RuntimeError, ValueError) as err:
        raise click.ClickException(f"{what} failed: {err}") from None
    except Exception as err:
        from control_plane.errors import ControlPlaneError  # e.g. the database is unreachable

        if isinstance(err, ControlPlaneError):
            raise click.ClickException(f"{what} failed: {err}") from None
        raise
    return 0


# ---- commands ----------------------------------------------------------------------------


@click.command("control-plane", cls=OrderedArgsCommand)
@click.option("--addr", type=HostPortType(), default="127.0.0.1:50051", show_default=True, help="Address to bind.")
@control_plane_options
@grammar_limit_options
@model_option
@click.option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="PEM certificate: serve TLS (with --tls-key).",
)
@click.option(
    "--tls-key", type=click.Path(exists=True, dir_okay=False), default=None, help="PEM private key of --tls-cert."
)
@click.option(
    "--max-lora-rank",
    type=click.IntRange(min=1),
    default=None,
    help="Refuse registering adapters above this rank (the workers' --max-lora-rank; default 64).",
)
@click.option(
    "--insecure-workers",
    is_flag=True,
    help="Without --worker-secret, let anyone who reaches this port join as a worker and "
    "download adapter bytes (trusted networks only). Default: worker RPCs are refused "
    "until a secret is set.",
)
@click.pass_context
def control_plane_cmd(
    ctx: click.Context,
    addr: str,
    data_dir: str,
    adapter_dirs: tuple[str, ...],
    lora: tuple[str, ...],
    lora_scaled: tuple[tuple[str, float], ...],
    lora_init_without_apply: bool,
    admin_token: str | None,
    worker_secret: str | None,
    model_path: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    insecure_workers: bool,
    **tuning: Any,
) -> None:
    """Run the control plane (adapter registry, default set, routing) until SIGINT/SIGTERM.

    Workers need the same ``--worker-secret`` / ``$LORAPLANE_WORKER_SECRET``; without one the
    worker RPCs are refused unless ``--insecure-workers`` (docs/security.md)."""
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together")
    adapters = _startup_adapters_from(ctx, lora, lora_scaled)
    run_control_plane, config_cls = load_control_plane()
    tuning["grammar_limits"] = grammar_limits_of(tuning)
    config = control_plane_config(
        config_cls,
        addr=addr,
        data_dir=data_dir,
        adapter_dirs=adapter_dirs,
        model_path=model_path,
        adapters=adapters,
        lora_init_without_apply=lora_init_without_apply,
        admin_token=admin_token,
        worker_secret=worker_secret,
        tls_cert=tls_cert,
        tls_key=tls_key,
        insecure_workers=insecure_workers,
        **tuning,
    )
    ctx.exit(_run_blocking("the control plane", lambda: run_control_plane(config)))


@click.command("worker")
@click.option(
    "--control-plane",
    "control_plane",
    type=HostPortListType(),
    default=None,
    metavar="HOST:PORT[,HOST:PORT…]",
    help="Control plane to register with: one address (a Service) or every replica, "
    "comma-separated (omit: standalone).",
)
@click.option(
    "--addr",
    type=HostPortType(),
    default="127.0.0.1:0",
    show_default=True,
    help="Address to bind (port 0 picks a free port).",
)
@click.option(
    "--advertise-addr",
    default=None,
    metavar="HOST:PORT",
    help="Address the control plane should dial (default: the bound one).",
)
@click.option("--worker-id", default="", help="Stable worker name (generated when empty).")
@click.option(
    "--adapter-dir",
    "adapter_dirs",
    multiple=True,
    type=click.Path(file_okay=False),
    help="Directory whose files LoadAdapter may read by server path (repeatable; "
    "none: server paths are refused, adapters arrive as bytes).",
)
@click.option(
    "--worker-secret",
    envvar=ENV_WORKER_SECRET,
    default=None,
    metavar="SECRET",
    help=f"Shared secret with the control plane (env {ENV_WORKER_SECRET}): required on "
    "every Worker RPC and sent on registration/heartbeats.",
)
@click.option(
    "--metrics-addr",
    type=HostPortType(),
    default=None,
    metavar="HOST:PORT",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (default: off).",
)
@click.option(
    "--metrics-max-adapters",
    type=click.IntRange(min=0),
    default=None,
    help="Distinct adapter label values in metrics before the rest fold into 'other' (default 64).",
)
@model_option
@worker_runtime_options
@click.pass_context
def worker_cmd(
    ctx: click.Context,
    control_plane: str | None,
    addr: str,
    advertise_addr: str | None,
    worker_id: str,
    adapter_dirs: tuple[str, ...],
    worker_secret: str | None,
    metrics_addr: str | None,
    metrics_max_adapters: int | None,
    model_path: str | None,
    n_slots: int,
    batching: str,
    prefix_cache: str,
    dtype: str,
    weight_form: str,
    device: str,
    n_ctx_slot: int | None,
    queue_limit: int | None,
    prefix_cache_tokens: int | None,
    max_loras: int | None,
    max_cpu_loras: int | None,
    max_lora_rank: int | None,
    drain_timeout_s: float | None,
    fairness: str | None,
    fairness_prompt_weight: float | None,
    fairness_output_weight: float | None,
    grammar_warmup: bool | None,
    **grammar: int | None,
) -> None:
    """Run a worker (base model, slots, caches) until SIGINT/SIGTERM (the first drains, see
    ``--drain-timeout``; a second stops at once)."""
    try:
        from worker.config import Batching, Fairness, PrefixCachePolicy, WorkerConfig
        from worker.rpc.server import serve_worker
    except ImportError as err:
        raise click.ClickException(f"the worker is not available: {err}") from None
    optional = {
        "n_ctx_seq": n_ctx_slot,
        "queue_limit": queue_limit,
        "prefix_cache_tokens": prefix_cache_tokens,
        "metrics_max_adapters": metrics_max_adapters,
        "metrics_addr": metrics_addr,
        "max_loras": max_loras,
        "max_cpu_loras": max_cpu_loras,
        "max_lora_rank": max_lora_rank,
        "drain_timeout_s": drain_timeout_s,
        "fairness": None if fairness is None else Fairness(fairness),
        "fairness_prompt_weight": fairness_prompt_weight,
        "fairness_output_weight": fairness_output_weight,
        "grammar_warmup": grammar_warmup,
        "grammar_limits": grammar_limits_of(dict(grammar)),
    }
    config = make_config(
        WorkerConfig,
        addr=addr,
        model_path=model_path,
        n_seqs=n_slots,
        batching=Batching(batching),
        prefix_cache=PrefixCachePolicy(prefix_cache),
        dtype=dtype,
        weight_form=weight_form,
        device=device,
        control_plane=control_plane,
        advertise_addr=advertise_addr,
        worker_id=worker_id,
        adapter_dirs=tuple(str(Path(d).resolve()) for d in adapter_dirs),
        worker_secret=worker_secret or None,
        **{k: v for k, v in optional.items() if v is not None},
    )
    ctx.exit(_run_blocking("the worker", lambda: serve_worker(config)))


@click.command("serve", cls=OrderedArgsCommand)
@click.option(
    "--addr",
    type=HostPortType(),
    default="127.0.0.1:50051",
    show_default=True,
    help="Control plane address (port 0 picks a free port).",
)
@control_plane_options
@model_option
@worker_runtime_options
@click.option(
    "--ready-timeout",
    type=click.FloatRange(min=1),
    default=600.0,
    show_default=True,
    metavar="SECONDS",
    help="How long the worker may take to load the model and register.",
)
@click.option(
    "--worker-metrics-addr",
    type=HostPortType(),
    default=None,
    metavar="HOST:PORT",
    help="The worker's Prometheus endpoint (default with --metrics-addr: a free 127.0.0.1 port).",
)
@click.pass_context
def serve_cmd(
    ctx: click.Context,
    addr: str,
    data_dir: str,
    adapter_dirs: tuple[str, ...],
    lora: tuple[str, ...],
    lora_scaled: tuple[tuple[str, float], ...],
    lora_init_without_apply: bool,
    admin_token: str | None,
    worker_secret: str | None,
    model_path: str | None,
    ready_timeout: float,
    worker_metrics_addr: str | None,
    **options: Any,
) -> None:
    """Run the control plane here and one worker subprocess; SIGINT/SIGTERM stops both.

    The two share a worker secret: ``--worker-secret`` / ``$LORAPLANE_WORKER_SECRET``, else a
    fresh random one; the worker gets it through its environment, never its command line.
    """
    from clients.serve import ServeSpec, resolve_port, run_serve
    from loraplane.worker_secret import new_worker_secret

    worker_secret = worker_secret or new_worker_secret()

    tuning = {k: options.pop(k) for k in CP_TUNING}
    runtime = options
    tuning["max_lora_rank"] = runtime.get("max_lora_rank")  # one flag for both processes
    # the worker gets the same bounds (its flags); --max-tools is the control plane's alone
    tuning["grammar_limits"] = grammar_limits_of({**runtime, "max_tools": tuning.pop("max_tools")})
    tuning["http_n_ctx"] = runtime.get("n_ctx_slot") or worker_default_n_ctx()  # size HTTP prompts for our worker
    adapters = _startup_adapters_from(ctx, lora, lora_scaled)
    run_control_plane, config_cls = load_control_plane()
    addr = resolve_port(addr)
    for key in ("http_addr", "metrics_addr"):  # real ports, so that they can be printed
        if tuning[key]:
            tuning[key] = resolve_port(tuning[key])
    if worker_metrics_addr is None and tuning["metrics_addr"]:
        worker_metrics_addr = "127.0.0.1:0"
    if worker_metrics_addr:
        worker_metrics_addr = resolve_port(worker_metrics_addr)
    config = control_plane_config(
        config_cls,
        addr=addr,
        data_dir=data_dir,
        adapter_dirs=adapter_dirs,
        model_path=model_path,
        adapters=adapters,
        lora_init_without_apply=lora_init_without_apply,
        admin_token=admin_token,
        worker_secret=worker_secret,
        **tuning,
    )
    spec = ServeSpec(
        cp_addr=addr,
        worker_args=worker_args(
            model_path=model_path,
            metrics_addr=worker_metrics_addr,
            metrics_max_adapters=tuning["metrics_max_adapters"],
            **runtime,
        ),
        ready_timeout_s=ready_timeout,
        worker_secret=worker_secret,
        api_key=tuning["api_key"] or None,
        http_addr=tuning["http_addr"],
        metrics_addr=tuning["metrics_addr"],
        worker_metrics_addr=worker_metrics_addr,
        # the worker drains for --drain-timeout (default 45 s), then exits; SIGKILL only after
        worker_stop_grace_s=(45.0 if runtime["drain_timeout_s"] is None else runtime["drain_timeout_s"]) + 15.0,
    )
    code = 0

    def run() -> None:
        nonlocal code
        code = run_serve(spec, run_control_plane, config)

    _run_blocking("serve", run)
    ctx.exit(code)


SERVER_COMMANDS = (serve_cmd, control_plane_cmd, worker_cmd)
