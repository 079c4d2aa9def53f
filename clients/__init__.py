"""Clients of loraplane: the Python library (`loraplane.clients.client`), the ``loraplane`` CLI
(`loraplane.clients.cli`) and, in ``clients/node/``, a Node.js client.

    from loraplane.clients import LoraplaneClient
"""

from loraplane.clients.client import (
    Adapter,
    AsyncLoraplaneClient,
    DefaultSet,
    GenerateResult,
    LoraplaneClient,
    LoraplaneError,
    ServerUnreachable,
    WorkerInfo,
)

__all__ = [
    "Adapter",
    "AsyncLoraplaneClient",
    "DefaultSet",
    "GenerateResult",
    "LoraplaneClient",
    "LoraplaneError",
    "ServerUnreachable",
    "WorkerInfo",
]
