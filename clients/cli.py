"""The ``loraplane`` command line: its flags, ``--json`` shapes and exit codes are a stable contract.

Commands are defined by concern in `clients.cli_client` (generate, adapters, default,
workers), `clients.cli_server` (serve, control-plane, worker), `clients.cli_tools`
(convert-peft, export-lora, bench) and `clients.demo`; this module assembles them and is the
console-script entry point (also ``python -m clients.cli``).

Exit codes: 0 success, 1 the server refused (or a tool failed), 2 usage error, 3 the server
cannot be reached, 130 interrupted. No Python traceback reaches the user; set
``LORAPLANE_DEBUG=1`` to see one for an unexpected internal error.
"""

from __future__ import annotations

import importlib.metadata
import sys

import click

from clients.cli_client import CLIENT_COMMANDS
from clients.cli_server import SERVER_COMMANDS
from clients.cli_tools import TOOL_COMMANDS
from clients.demo import demo_cmd
from clients.params import env_flag
from loraplane.env import ENV_DEBUG

EXIT_INTERNAL = 1


def _version() -> str:
    try:
        return importlib.metadata.version("loraplane")
    except importlib.metadata.PackageNotFoundError:  # running from a checkout, not installed
        return "0+unknown"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(version=_version(), prog_name="loraplane", message="%(prog)s %(version)s")
def cli() -> None:
    """loraplane: one GGUF base model, many LoRA adapters, served over gRPC.

    Start a server with `loraplane serve` (or `loraplane demo`), then use the client
    commands against it (--addr, default $LORAPLANE_ADDR or 127.0.0.1:50051).
    """


for _command in (*CLIENT_COMMANDS, *SERVER_COMMANDS, *TOOL_COMMANDS, demo_cmd):
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
