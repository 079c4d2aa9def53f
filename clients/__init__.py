"""The Python client library of loraplane (`clients.client`); it knows no command line.

    from clients import LoraplaneClient

The ``loraplane`` CLI, a user of this library, is the sub-package `clients.cli`; a Node.js
client lives in ``clients/node/``.
"""

from clients.async_client import AsyncLoraplaneClient
from clients.client import (
    Adapter,
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
