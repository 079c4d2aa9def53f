"""click parameter types and shared option groups of the ``loraplane`` CLI.

Every malformed value is a ``click.BadParameter`` here, so it ends as click's usage error
(exit code 2) before any connection is made.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from loraplane.compute_spec import DEVICE_METAVAR, check_device_spec
from loraplane.env import ENV_ADDR, ENV_ADMIN_TOKEN, ENV_API_KEY

UINT32_MAX = 2**32 - 1  # ids and counts are uint32 on the wire
UINT64_MAX = 2**64 - 1

DEFAULT_ADDR = "127.0.0.1:50051"

F = TypeVar("F", bound=Callable[..., Any])


def _finite_float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{what} {text!r} is not finite")
    return value


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
            return _adapter_key(key_text), _finite_float(scale_text, "scale")
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


class PathScaleType(click.ParamType):
    """``PATH:SCALE`` (scale required) or, with ``optional_scale``, ``PATH[:SCALE]``."""

    def __init__(self, optional_scale: bool = False) -> None:
        self.optional_scale = optional_scale
        self.name = "PATH[:SCALE]" if optional_scale else "PATH:SCALE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, float]:
        if isinstance(value, tuple):
            return value
        text = str(value)
        path, sep, scale_text = text.rpartition(":")
        if sep and path:
            try:
                return path, _finite_float(scale_text, "scale")
            except ValueError as err:
                if not self.optional_scale:
                    self.fail(f"{text!r}: {err}", param, ctx)
        if self.optional_scale:
            return text, 1.0
        self.fail(f"{text!r} is not PATH:SCALE (e.g. shout.gguf:0.5)", param, ctx)


class HostPortType(click.ParamType):
    """``HOST:PORT`` for addresses a server binds (port 0 only where ``allow_zero``)."""

    name = "HOST:PORT"

    def __init__(self, allow_zero: bool = True) -> None:
        self.allow_zero = allow_zero

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        host, sep, port_text = text.rpartition(":")
        if not sep or not host or not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
            self.fail(f"{text!r} is not HOST:PORT", param, ctx)
        if int(port_text) == 0 and not self.allow_zero:
            self.fail(f"{text!r}: port 0 is not allowed here", param, ctx)
        return text


class HostPortListType(click.ParamType):
    """``HOST:PORT[,HOST:PORT…]`` (addresses to dial: port 0 refused) → the same text,
    whitespace removed; every element is checked like `HostPortType`."""

    name = "HOST:PORT[,HOST:PORT…]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        parts = [p.strip() for p in str(value).split(",")]
        if not all(parts):
            self.fail(f"{value!r}: empty address in the list", param, ctx)
        one = HostPortType(allow_zero=False)
        return ",".join(one.convert(p, param, ctx) for p in parts)


class DeviceType(click.ParamType):
    """A worker ``--device``: ``cpu``, ``cpu:0``, ``cuda``, ``cuda:N`` or ``auto``
    (`loraplane.compute_spec.check_device_spec`) → its normalized spelling. Only the spelling
    is checked here; the worker refuses a GPU it does not have when it loads the model."""

    name = DEVICE_METAVAR

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            return check_device_spec(str(value))
        except ValueError as err:
            self.fail(str(err), param, ctx)


ADAPTER_SCALE = AdapterScaleType()
DEVICE = DeviceType()
ADAPTER_REF = AdapterRefType()
TOKEN_IDS = TokenIdsType()
PATH_SCALE = PathScaleType()
PATH_OPTIONAL_SCALE = PathScaleType(optional_scale=True)


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
