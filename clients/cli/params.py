"""click parameter types and shared option groups of the ``loraplane`` CLI.

Every malformed value is a ``click.BadParameter`` here, so it ends as click's usage error
(exit code 2) before any connection is made.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from loraplane.env import ENV_ADDR, ENV_ADMIN_TOKEN, ENV_API_KEY
from loraplane.options import finite_float

UINT32_MAX = 2**32 - 1  # ids and counts are uint32 on the wire
UINT64_MAX = 2**64 - 1

DEFAULT_ADDR = "127.0.0.1:50051"

F = TypeVar("F", bound=Callable[..., Any])


_ASCII_INT = re.compile(r"-?[0-9]+")


def _ascii_int(text: str) -> int | None:
    """``text`` as an integer when it is ASCII digits (an optional ``-``), else None: ``int()``
    alone takes any Unicode digit (``"٣"`` is 3), ``+``, spaces and ``_`` separators."""
    text = text.strip()
    return int(text) if _ASCII_INT.fullmatch(text) else None


def _adapter_id(text: str) -> int:
    value = _ascii_int(text)
    if value is None:
        raise ValueError(f"adapter id {text!r} is not an integer (ASCII digits)")
    if not 0 <= value <= UINT32_MAX:
        raise ValueError(f"adapter id {value} is out of range (0..{UINT32_MAX})")
    return value


AdapterKey = int | str
"""An adapter as the CLI names it: an id (ASCII digits) or a name / alias, resolved by the
control plane (`control_plane.resolution.find_adapter`, the rule HTTP ``model`` follows too)."""


def _adapter_key(text: str) -> AdapterKey:
    """ASCII digits only (or with a ``-``: refused as out of range) → an id (range-checked: an
    all-digit token is never a name); anything else non-empty → a name, left for the control
    plane to resolve."""
    if _ASCII_INT.fullmatch(text):
        return _adapter_id(text)
    if not text:
        raise ValueError("empty adapter id or name")
    return text


class AdapterScaleType(click.ParamType):
    """``ID=SCALE`` or ``NAME=SCALE`` → ``(id or name, scale)`` (the last ``=`` splits)."""

    name = "ID|NAME=SCALE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[AdapterKey, float]:
        if isinstance(value, tuple):
            return value
        key_text, sep, scale_text = str(value).rpartition("=")
        if not sep:
            self.fail(f"{value!r} is not ID=SCALE or NAME=SCALE (e.g. 0=1.0, shout=0.5)", param, ctx)
        try:
            return _adapter_key(key_text), finite_float(scale_text, "scale")
        except ValueError as err:
            self.fail(f"{value!r}: {err}", param, ctx)


class AdapterRefType(click.ParamType):
    """An adapter id (ASCII digits, ``0..UINT32_MAX``) or a name / alias (anything else)."""

    name = "ID|NAME"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> AdapterKey:
        if isinstance(value, int):
            return value
        try:
            return _adapter_key(str(value))
        except ValueError as err:
            self.fail(str(err), param, ctx)


class AdapterIdType(click.ParamType):
    """An adapter id: ASCII digits, ``0..UINT32_MAX`` (``click.IntRange`` would take ``"٣"``)."""

    name = "ID"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return _adapter_id(str(value))
        except ValueError as err:
            self.fail(str(err), param, ctx)


class TokenIdsType(click.ParamType):
    """``ID,ID,…`` → a non-empty tuple of non-negative token ids."""

    name = "ID,ID,…"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        parts = [p.strip() for p in str(value).split(",") if p.strip()]
        if not parts:
            self.fail("no token ids given", param, ctx)
        ids = []
        for part in parts:
            token = _ascii_int(part)
            if token is None:
                self.fail(f"token id {part!r} is not an integer (ASCII digits)", param, ctx)
            if not 0 <= token <= UINT32_MAX:
                self.fail(f"token id {token} is out of range (0..{UINT32_MAX})", param, ctx)
            ids.append(token)
        return tuple(ids)


ADAPTER_SCALE = AdapterScaleType()
ADAPTER_REF = AdapterRefType()
TOKEN_IDS = TokenIdsType()


def scales_to_map(pairs: Sequence[tuple[AdapterKey, float]], param_hint: str) -> dict[AdapterKey, float]:
    """``[(id or name, scale), …]`` → ``{id or name: scale}``; one given twice is a usage error
    (an id and a name of the same adapter are caught by the control plane)."""
    out: dict[AdapterKey, float] = {}
    for adapter_id, scale in pairs:
        if adapter_id in out:
            what = f"adapter id {adapter_id}" if isinstance(adapter_id, int) else f"adapter '{adapter_id}'"
            raise click.BadParameter(f"{what} is given more than once", param_hint=param_hint)
        out[adapter_id] = scale
    return out


def client_options(f: F) -> F:
    """The options every client command takes: --addr, --json, --admin-token, timeouts."""
    options = [
        click.option(
            "--addr",
            envvar=ENV_ADDR,
            default=DEFAULT_ADDR,
            show_default=True,
            metavar="HOST:PORT[,HOST:PORT…]",
            help="Control plane address, or every replica's, comma-separated: calls "
            f"move to the next when one fails (env {ENV_ADDR}).",
        ),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout (errors too)."),
        click.option(
            "--admin-token",
            envvar=ENV_ADMIN_TOKEN,
            default=None,
            metavar="TOKEN",
            help=f"Bearer token for admin calls (env {ENV_ADMIN_TOKEN}).",
        ),
        click.option(
            "--api-key",
            envvar=ENV_API_KEY,
            default=None,
            metavar="KEY",
            help=f"Inference API key of a control plane started with --api-key (env {ENV_API_KEY}); "
            "the admin token, when given, is sent instead.",
        ),
        click.option(
            "--timeout",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            metavar="SECONDS",
            help="Deadline of each call (default: none).",
        ),
        click.option(
            "--connect-timeout",
            type=click.FloatRange(min=0, min_open=True),
            default=5.0,
            show_default=True,
            metavar="SECONDS",
            help="How long to wait for the server to accept the connection.",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}
