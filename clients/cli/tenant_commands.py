"""``loraplane tenants add | update | list | remove``: tenants, their API keys and quotas.

Admin commands (the admin token when the control plane has one). ``--json`` shapes, as the
other groups': ``add`` and ``update`` print the tenant object (``add`` with ``api_key`` added:
the key in clear, shown this once), ``list`` prints ``{"tenants": [...]}``, ``remove`` prints
``{"name", "removed": true}``. A tenant object: ``{"name", "weight", "priority",
"max_concurrent", "tokens_per_minute", "requests_per_minute", "key_count", "usage":
{"in_flight", "tokens_available", "requests_available", "requests_total", "tokens_total",
"rejected_total"}}`` (limits 0: unlimited). Exit codes as every client command's: 1 for a
refusal (ALREADY_EXISTS, NOT_FOUND, INVALID_ARGUMENT, …), 2 usage, 3 unreachable.

The tenant's own key is ``--key`` (not ``--api-key``: that is every client command's
credential, and ``$LORAPLANE_API_KEY`` in the environment must never become a new tenant's key).
"""

from __future__ import annotations

from typing import Any

import click

from clients.cli.client_commands import _opts, server_call
from clients.cli.params import UINT32_MAX, client_options

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT63_MAX = 2**63 - 1


def _limit_options(f: Any) -> Any:
    """The settings both ``add`` and ``update`` take (unset: default / unchanged)."""
    options = [
        click.option(
            "--weight",
            type=click.FloatRange(min=0, min_open=True, max=1e6),
            default=None,
            help="Fair share on the workers (VTC weight; default 1).",
        ),
        click.option(
            "--priority",
            type=click.IntRange(INT32_MIN, INT32_MAX),
            default=None,
            help="Priority class on the workers: lower is served first (default 0).",
        ),
        click.option(
            "--max-concurrent",
            type=click.IntRange(0, UINT32_MAX),
            default=None,
            metavar="N",
            help="Requests in flight over all control-plane replicas (0: unlimited).",
        ),
        click.option(
            "--tokens-per-minute",
            type=click.IntRange(0, INT63_MAX),
            default=None,
            metavar="N",
            help="Prompt + output tokens per minute; a request reserves prompt + max_tokens (0: unlimited).",
        ),
        click.option(
            "--requests-per-minute",
            type=click.IntRange(0, INT63_MAX),
            default=None,
            metavar="N",
            help="Requests per minute (0: unlimited).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    keys = ("weight", "priority", "max_concurrent", "tokens_per_minute", "requests_per_minute")
    return {k: kwargs.pop(k) for k in keys}


@click.group()
def tenants() -> None:
    """Tenants: who requests are accounted to, their API keys and quotas.

    A request's tenant is the one its API key maps to; --api-key maps to "default"; without
    a key, "adapter:<first adapter of its explicit map>", else "anonymous". Names without a
    row have no limits; `tenants add default|anonymous|adapter:NAME …` gives them some.
    """


@tenants.command("add")
@click.argument("name")
@click.option(
    "--key",
    "key",
    default=None,
    metavar="KEY",
    help="The tenant's API key (16+ printable characters); default: a generated one, printed once.",
)
@_limit_options
@client_options
def tenants_add(name: str, key: str | None, **kwargs: Any) -> None:
    """Add tenant NAME with one API key (stored hashed: the key is printed this once)."""
    if key is not None and not key:  # `--key ""` (an unset variable): never a silently generated key
        raise click.BadParameter("is empty; leave --key out to have a key generated", param_hint="--key")
    settings = _settings(kwargs)
    opts = _opts(kwargs)
    with server_call(opts) as client:
        tenant, api_key = client.add_tenant(name, api_key=key, **settings)
    from clients.cli.render import print_json

    if opts.as_json:
        print_json({**tenant.to_json(), "api_key": api_key})
    else:
        click.echo(f"added tenant {tenant.name}")
        click.echo(f"API key (shown once; store it now): {api_key}")


@tenants.command("update")
@click.argument("name")
@_limit_options
@client_options
def tenants_update(name: str, **kwargs: Any) -> None:
    """Change settings of tenant NAME (those not given keep their value)."""
    settings = _settings(kwargs)
    opts = _opts(kwargs)
    if all(v is None for v in settings.values()):
        raise click.UsageError("give at least one setting to change (--weight, --priority, --max-concurrent, …)")
    with server_call(opts) as client:
        tenant = client.update_tenant(name, **settings)
    from clients.cli.render import print_json, stdout_console, tenants_table

    if opts.as_json:
        print_json(tenant.to_json())
    else:
        stdout_console().print(tenants_table([tenant]))


@tenants.command("list")
@client_options
def tenants_list(**kwargs: Any) -> None:
    """List tenants with their limits and current usage (all replicas)."""
    opts = _opts(kwargs)
    with server_call(opts) as client:
        found = client.list_tenants()
    from clients.cli.render import print_json, stdout_console, tenants_table

    if opts.as_json:
        print_json({"tenants": [t.to_json() for t in found]})
    else:
        stdout_console().print(tenants_table(found))


@tenants.command("remove")
@click.argument("name")
@client_options
def tenants_remove(name: str, **kwargs: Any) -> None:
    """Remove tenant NAME and its API keys (its requests in flight finish)."""
    opts = _opts(kwargs)
    with server_call(opts) as client:
        client.remove_tenant(name)
    from clients.cli.render import print_json

    if opts.as_json:
        print_json({"name": name, "removed": True})
    else:
        click.echo(f"removed tenant {name}")


TENANT_COMMANDS = (tenants,)
