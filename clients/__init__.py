"""Clients of loraplane: the Python library (`clients.client`), the ``loraplane`` CLI
(`clients.cli`) and, in ``clients/node/``, a Node.js client.

    from clients import LoraplaneClient
"""

from clients.client import (
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
