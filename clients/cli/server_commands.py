"""Server commands of the ``loraplane`` CLI: ``control-plane``, ``worker`` and ``serve`` (the
launcher).

Each server's options live beside its config (`control_plane.options`, `worker.options`),
named after the config's fields; a command here lists them, turns their values into the
config, and runs the server. ``serve`` splits its values between the two by those names. The
servers themselves (``control_plane.server``, ``worker.rpc.server``) are imported inside the
commands so that the CLI starts fast (no torch import for client commands or ``--help``).

Start-up adapters register in command-line order across ``--lora`` and ``--lora-scaled``
("in the order given", as llama-server). click collects each option into its
own list, so `OrderedArgsCommand` keeps the raw arguments and `startup_adapters` restores the
interleaving; the control plane then gets them all in ``lora_scaled`` (``--lora PATH`` is
``PATH:1.0``) and an empty ``lora`` list, which keeps that order whatever it does with the two.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import click

from clients.peft import adapter_source_problem
from control_plane.options import CONTROL_PLANE_OPTIONS, STANDALONE_OPTIONS, control_plane_config
from loraplane.options import GRAMMAR_LIMIT_OPTIONS, MODEL_OPTION, HostPortType, option_names
from worker.options import (
    WORKER_OPTIONS,
    WORKER_RUNTIME_OPTIONS,
    drain_timeout_of,
    n_ctx_of,
    worker_argv,
    worker_config,
)

RAW_ARGS_KEY = "loraplane.raw_args"


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
    problem = adapter_source_problem(path)
    if problem is not None:
        raise click.BadParameter(problem, param_hint=flag)
    return os.path.abspath(path)


def load_control_plane() -> Callable[..., Any]:
    """``control_plane.server.run_control_plane``, imported now (it loads the registry, its
    store and the HTTP front).

    Raises:
        click.ClickException: the control plane cannot be imported (a dependency is missing).
    """
    try:
        from control_plane.server import run_control_plane
    except ImportError as err:
        raise click.ClickException(f"the control plane is not available: {err}") from None
    return run_control_plane


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

CONTROL_PLANE_ADDR = click.Option(
    ["--addr"], type=HostPortType(), default="127.0.0.1:50051", show_default=True, help="Address to bind."
)


@click.command(
    "control-plane",
    cls=OrderedArgsCommand,
    params=[CONTROL_PLANE_ADDR, *CONTROL_PLANE_OPTIONS, *GRAMMAR_LIMIT_OPTIONS, MODEL_OPTION, *STANDALONE_OPTIONS],
)
@click.pass_context
def control_plane_cmd(ctx: click.Context, **options: Any) -> None:
    """Run the control plane (adapter registry, default set, routing) until SIGINT/SIGTERM.

    Workers need the same ``--worker-secret`` / ``$LORAPLANE_WORKER_SECRET``; without one the
    worker RPCs are refused unless ``--insecure-workers`` (docs/security.md)."""
    if bool(options["tls_cert"]) != bool(options["tls_key"]):
        raise click.UsageError("--tls-cert and --tls-key go together")
    adapters = _startup_adapters_from(ctx, options["lora"], options["lora_scaled"])
    run_control_plane = load_control_plane()
    config = control_plane_config(options, adapters=adapters)
    ctx.exit(_run_blocking("the control plane", lambda: run_control_plane(config)))


@click.command("worker", params=[*WORKER_OPTIONS, MODEL_OPTION, *WORKER_RUNTIME_OPTIONS])
@click.pass_context
def worker_cmd(ctx: click.Context, **options: Any) -> None:
    """Run a worker (base model, slots, caches) until SIGINT/SIGTERM (the first drains, see
    ``--drain-timeout``; a second stops at once)."""
    config = worker_config(options)
    try:
        from worker.rpc.server import serve_worker
    except ImportError as err:
        raise click.ClickException(f"the worker is not available: {err}") from None
    ctx.exit(_run_blocking("the worker", lambda: serve_worker(config)))


SERVE_OPTIONS = (
    click.Option(
        ["--addr"],
        type=HostPortType(),
        default="127.0.0.1:50051",
        show_default=True,
        help="Control plane address (port 0 picks a free port).",
    ),
    *CONTROL_PLANE_OPTIONS,
    MODEL_OPTION,
    *WORKER_RUNTIME_OPTIONS,
    click.Option(
        ["--ready-timeout"],
        type=click.FloatRange(min=1),
        default=600.0,
        show_default=True,
        metavar="SECONDS",
        help="How long the worker may take to load the model and register.",
    ),
    click.Option(
        ["--worker-metrics-addr"],
        type=HostPortType(),
        default=None,
        metavar="HOST:PORT",
        help="The worker's Prometheus endpoint (default with --metrics-addr: a free 127.0.0.1 port).",
    ),
)
"""``serve``'s options: the control plane's, ``--model`` (both servers'), the worker's runtime
options (forwarded), and two of its own."""

_CP_NAMES = option_names(CONTROL_PLANE_OPTIONS)
_GRAMMAR_NAMES = option_names(GRAMMAR_LIMIT_OPTIONS)


@click.command("serve", cls=OrderedArgsCommand, params=list(SERVE_OPTIONS))
@click.pass_context
def serve_cmd(
    ctx: click.Context,
    addr: str,
    model_path: str | None,
    ready_timeout: float,
    worker_metrics_addr: str | None,
    **options: Any,
) -> None:
    """Run the control plane here and one worker subprocess; SIGINT/SIGTERM stops both.

    The two share a worker secret: ``--worker-secret`` / ``$LORAPLANE_WORKER_SECRET``, else a
    fresh random one; the worker gets it through its environment, never its command line.
    """
    from clients.cli.serve import ServeSpec, resolve_port, run_serve
    from loraplane.worker_secret import new_worker_secret

    cp = {name: options.pop(name) for name in _CP_NAMES}
    runtime = options  # the worker's runtime options: what is left
    cp["worker_secret"] = cp["worker_secret"] or new_worker_secret()
    cp["max_lora_rank"] = runtime["max_lora_rank"]  # one flag for both processes
    # the worker's structured-output bounds hold for the control plane too (--max-tools is its own)
    cp.update({name: runtime[name] for name in _GRAMMAR_NAMES})
    cp["http_n_ctx"] = n_ctx_of(runtime)  # size HTTP prompts for our worker
    adapters = _startup_adapters_from(ctx, cp["lora"], cp["lora_scaled"])
    run_control_plane = load_control_plane()
    cp["addr"] = resolve_port(addr)
    for key in ("http_addr", "metrics_addr"):  # real ports, so that they can be printed
        if cp[key]:
            cp[key] = resolve_port(cp[key])
    if worker_metrics_addr is None and cp["metrics_addr"]:
        worker_metrics_addr = "127.0.0.1:0"
    if worker_metrics_addr:
        worker_metrics_addr = resolve_port(worker_metrics_addr)
    config = control_plane_config({**cp, "model_path": model_path}, adapters=adapters)
    spec = ServeSpec(
        cp_addr=cp["addr"],
        worker_args=worker_argv(
            {
                "model_path": model_path,
                "metrics_addr": worker_metrics_addr,
                "metrics_max_adapters": cp["metrics_max_adapters"],
                **runtime,
            }
        ),
        ready_timeout_s=ready_timeout,
        worker_secret=cp["worker_secret"],
        api_key=cp["api_key"] or None,
        http_addr=cp["http_addr"],
        metrics_addr=cp["metrics_addr"],
        worker_metrics_addr=worker_metrics_addr,
        # the worker drains for --drain-timeout, then exits; SIGKILL only after
        worker_stop_grace_s=drain_timeout_of(runtime) + 15.0,
    )
    code = 0

    def run() -> None:
        nonlocal code
        code = run_serve(spec, run_control_plane, config)

    _run_blocking("serve", run)
    ctx.exit(code)


SERVER_COMMANDS = (serve_cmd, control_plane_cmd, worker_cmd)
