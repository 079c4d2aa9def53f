"""The ``loraplane`` command line (`clients.cli.main`), a user of the client library in
``clients/``: its flags, ``--json`` shapes, ids and exit codes are a stable contract.

Commands by concern: `clients.cli.client_commands` (generate, adapters, default, workers),
`clients.cli.tenant_commands` (tenants), `clients.cli.server_commands` (serve, control-plane,
worker: the launcher; each server's options live beside its config, in
`control_plane.options` and `worker.options`), `clients.cli.tool_commands` (convert-peft,
export-lora, bench) and `clients.cli.demo`. ``python -m clients.cli`` runs it.
"""
