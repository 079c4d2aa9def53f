"""The installed loraplane's version, as ``loraplane --version`` and ``GET /version`` say it."""

from __future__ import annotations

import importlib.metadata


def package_version() -> str:
    """The ``loraplane`` distribution's version (``pyproject.toml``), or ``"0+unknown"`` when
    the code runs from a checkout that was never installed."""
    try:
        return importlib.metadata.version("loraplane")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"
