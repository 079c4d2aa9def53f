"""The click pieces both servers' option modules (`control_plane.options`, `worker.options`)
and the ``loraplane`` CLI share: parameter types (``PATH:SCALE``, ``HOST:PORT``, a device),
checks click's ranges miss (finite durations and weights), ``--model``, and the bounds on
structured output (`GRAMMAR_LIMIT_OPTIONS` → ``loraplane.grammar_limits.GrammarLimits``).

An option here is a ``click.Option`` object, so a command lists it in ``params=`` and its
destination (``option.name``) can be read back: each server's options are named after the
fields of its config dataclass, and ``serve`` splits its values between the two servers by
those names.

Every malformed value is a ``click.BadParameter``, so it ends as click's usage error (exit
code 2) before anything starts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import click

from loraplane.compute_spec import DEVICE_METAVAR, check_device_spec
from loraplane.grammar_limits import GrammarLimits


def finite_float(text: str, what: str) -> float:
    """``text`` as a float.

    Raises:
        ValueError: not a number, or not finite (``inf``, ``nan``); the message names ``what``.
    """
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{what} {text!r} is not finite")
    return value


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
                return path, finite_float(scale_text, "scale")
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


DEVICE = DeviceType()
PATH_SCALE = PathScaleType()
PATH_OPTIONAL_SCALE = PathScaleType(optional_scale=True)


def positive_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A duration: a finite number of seconds > 0 (click's FloatRange lets inf and nan through)."""
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise click.BadParameter(f"{value} is not a finite number of seconds > 0", ctx=ctx, param=param)
    return value


def positive_weight(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A fairness weight: a finite number > 0 (click's FloatRange lets inf and nan through)."""
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise click.BadParameter(f"{value} is not a finite number > 0", ctx=ctx, param=param)
    return value


def option_names(options: Iterable[click.Parameter]) -> tuple[str, ...]:
    """The destinations (keyword names in a command's callback) of ``options``, in order."""
    return tuple(option.name for option in options if option.name is not None)


MODEL_OPTION = click.Option(
    ["--model", "model_path"],
    default=None,
    metavar="PATH",
    help="Base model GGUF (default: the embedded Gemma 3 270M).",
)
"""``--model``: the base model both servers load (``model_path`` in both configs)."""


GRAMMAR_LIMIT_OPTIONS = (
    click.Option(
        ["--grammar-max-bytes"],
        type=click.IntRange(min=1),
        default=None,
        metavar="BYTES",
        help="Largest structured-output schema / regex / grammar text, and guided_choice list "
        "(default 262144); larger is refused with 400 / INVALID_ARGUMENT.",
    ),
    click.Option(
        ["--grammar-max-depth"],
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Longest chain of nested schemas through $refs, or of grammar rule references, in a "
        "structured-output format (default 128).",
    ),
    click.Option(
        ["--grammar-max-rules"],
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Most $defs of a JSON Schema, rules of a Lark or GBNF grammar (default 1024).",
    ),
    click.Option(
        ["--grammar-max-choices"],
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Most strings in a guided_choice list (default 1024).",
    ),
)
"""Bounds on structured output (`GrammarLimits`): the control plane's, the worker's (``serve``
gives both the same). The control plane's ``--max-tools`` completes them
(`control_plane.options`)."""

GRAMMAR_LIMIT_FIELDS = {
    "grammar_max_bytes": "max_bytes",
    "grammar_max_depth": "max_depth",
    "grammar_max_rules": "max_rules",
    "grammar_max_choices": "max_choices",
    "max_tools": "max_tools",
}
"""Option name → `GrammarLimits` field, for `GRAMMAR_LIMIT_OPTIONS` and ``--max-tools``."""


def grammar_limits_of(values: dict[str, Any]) -> GrammarLimits | None:
    """The `GrammarLimits` of the `GRAMMAR_LIMIT_FIELDS` options in ``values`` (removed from
    it); None when none was given (the config's default)."""
    given = {field: values.pop(name) for name, field in GRAMMAR_LIMIT_FIELDS.items() if name in values}
    given = {k: v for k, v in given.items() if v is not None}
    return GrammarLimits(**given) if given else None


def option_argv(options: Sequence[click.Option], values: Mapping[str, Any]) -> list[str]:
    """The command-line arguments that give ``options`` the ``values`` (by option name) again:
    ``[flag, str(value)]`` per value (per item of a repeatable option), ``flag`` /
    ``--no-flag`` for a boolean flag pair, nothing for a value that is None (the receiving
    command's default). Options whose names are not in ``values`` are skipped.

    Raises:
        TypeError: ``values`` names something none of ``options`` is.
    """
    known = set(option_names(options))
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"no option named {', '.join(map(repr, unknown))}")
    args: list[str] = []
    for option in options:
        value = values.get(option.name) if option.name else None
        if value is None:
            continue
        if option.is_bool_flag:
            flags = option.opts if value else option.secondary_opts
            if flags:
                args.append(flags[0])
        elif option.multiple:
            for item in value:
                args += [option.opts[0], str(item)]
        else:
            args += [option.opts[0], str(value)]
    return args
