"""The ``loraplane`` command line: its flags, ``--json`` shapes and exit codes are a stable contract.

Commands are defined by concern in `clients.cli.client_commands` (generate, adapters, default,
workers), `clients.cli.tenant_commands` (tenants), `clients.cli.server_commands` (serve,
control-plane, worker), `clients.cli.tool_commands` (convert-peft, export-lora, bench) and
`clients.cli.demo`; this module assembles them and is the console-script entry point
(also ``python -m clients.cli``).

Exit codes: 0 success, 1 the server refused (or a tool failed), 2 usage error, 3 the server
cannot be reached, 130 interrupted. With ``--json`` a usage error too is one JSON object on
stdout, ``{"error": {"code": "INVALID_ARGUMENT", "message": …}}`` (exit 2). No Python traceback reaches the user; set
``LORAPLANE_DEBUG=1`` to see one for an unexpected internal error.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import click

from clients.cli.client_commands import CLIENT_COMMANDS
from clients.cli.demo import demo_cmd
from clients.cli.params import env_flag
from clients.cli.server_commands import SERVER_COMMANDS
from clients.cli.tenant_commands import TENANT_COMMANDS
from clients.cli.tool_commands import TOOL_COMMANDS
from loraplane.env import ENV_DEBUG
from loraplane.version import package_version

EXIT_INTERNAL = 1


_JSON_KEY = "loraplane.json"
USAGE_ERROR_CODE = "INVALID_ARGUMENT"  # the gRPC status name a usage error's JSON carries


def wants_json(args: list[str]) -> bool:
    """Whether ``--json`` is among ``args`` (before a ``--`` that ends the options)."""
    for arg in args:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


def hoist_json(args: list[str]) -> list[str]:
    """``--json`` given before the command (``loraplane --json adapters list``) moved to the
    command's own options, where it is defined (``adapters list --json``); nothing else moves."""
    lead = 0
    while lead < len(args) and args[lead] == "--json":
        lead += 1
    if lead == 0 or lead == len(args):
        return list(args)
    rest = list(args[lead:])
    end = rest.index("--") if "--" in rest else len(rest)
    return rest[:end] + ["--json"] + rest[end:]


def _usage_error(err: click.UsageError, as_json: bool) -> NoReturn:
    """Re-raise ``err`` (click prints usage and the message on stderr, exit 2); with
    ``--json``, print the CONTRACT's error object on stdout instead and exit with the same code:
    ``{"error": {"code": "INVALID_ARGUMENT", "message": "<command path>: <message>"}}``."""
    if not as_json:
        raise err
    from clients.cli.render import print_json

    where = err.ctx.command_path if err.ctx is not None else "loraplane"
    print_json({"error": {"code": USAGE_ERROR_CODE, "message": f"{where}: {err.format_message()}"}})
    raise click.exceptions.Exit(err.exit_code)


class CliGroup(click.Group):
    """The top-level group: a usage error anywhere below it (bad flag, missing argument, bad
    value, unknown command) honours ``--json`` anywhere on the command line (`_usage_error`);
    a leading ``--json`` applies to the command (`hoist_json`)."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any):
        as_json = wants_json(args)
        args = hoist_json(args)
        try:
            ctx = super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as err:
            _usage_error(err, as_json)
        ctx.meta[_JSON_KEY] = as_json
        return ctx

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as err:
            _usage_error(err, bool(ctx.meta.get(_JSON_KEY)))


@click.group(cls=CliGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(version=package_version(), prog_name="loraplane", message="%(prog)s %(version)s")
def cli() -> None:
    """loraplane: one GGUF base model, many LoRA adapters, served over gRPC.

    Start a server with `loraplane serve` (or `loraplane demo`), then use the client
    commands against it (--addr, default $LORAPLANE_ADDR or 127.0.0.1:50051).
    """


for _command in (*CLIENT_COMMANDS, *TENANT_COMMANDS, *SERVER_COMMANDS, *TOOL_COMMANDS, demo_cmd):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point; exits the process with the command's exit code."""
    try:
        cli.main(args=argv, prog_name="loraplane")
    except Exception as err:  # noqa: BLE001 - last resort: never show a traceback
        if env_flag(ENV_DEBUG):
            raise
        click.echo(
            f"loraplane: internal error: {type(err).__name__}: {err} (set LORAPLANE_DEBUG=1 for a traceback)", err=True
        )
        sys.exit(EXIT_INTERNAL)


if __name__ == "__main__":
    main()
