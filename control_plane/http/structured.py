"""Structured output over HTTP: OpenAI ``response_format`` and vLLM's guided-decoding fields.

Accepted on ``/v1/completions`` and ``/v1/chat/completions`` (one of them per request):

- OpenAI ``response_format``: ``{"type": "text"}`` (unconstrained), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
- vLLM's older extensions ``guided_json`` (a schema object or its JSON text),
  ``guided_regex``, ``guided_grammar`` (Lark, llguidance's native form; llama.cpp GBNF is
  converted), ``guided_choice`` (a list of strings);
- vLLM's newer ``structured_outputs`` object with the keys ``json``, ``regex``, ``grammar``,
  ``choice``, ``json_object``.

The result is the ``loraplane.v1.ResponseFormat`` of the request's ``SamplingParams``. The
format is compiled here, in the control plane's grammar-check child processes
(`control_plane.grammar_check`, limits first, no vocabulary needed): a bad schema,
regex or grammar, or one over a limit, is a 400 in OpenAI's error shape whose ``param`` names
the field and whose message carries the reason.
"""

from __future__ import annotations

import json
from typing import Any

from control_plane.grammar_check import InlineChecker, TenantChecker
from control_plane.http.errors import OpenAIError, unsupported
from loraplane.grammar_limits import GrammarError, GrammarLimits, check_choices
from loraplane.response_format import ResponseFormat, choice_grammar
from loraplane.v1 import common_pb2

_PB_TYPE = {
    "json_object": common_pb2.ResponseFormat.TYPE_JSON_OBJECT,
    "json_schema": common_pb2.ResponseFormat.TYPE_JSON_SCHEMA,
    "regex": common_pb2.ResponseFormat.TYPE_REGEX,
    "grammar": common_pb2.ResponseFormat.TYPE_GRAMMAR,
}


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_response_format")


def _schema_text(value: Any, param: str) -> str:
    """A schema given as an object or as JSON text, as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            raise _bad(param, f"'{param}' is not valid JSON: nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, or an integer past Python's int-str digit limit
            raise _bad(param, f"'{param}' is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise _bad(param, f"'{param}' must be a JSON Schema object, got {type(value).__name__}")
    return json.dumps(value)


def _choice_grammar(choices: Any, param: str, limits: GrammarLimits) -> str:
    """A Lark grammar matching exactly one of ``choices`` (vLLM ``guided_choice``), within
    ``limits`` (count and total bytes)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise _bad(param, f"'{param}' must be a non-empty list of non-empty strings")
    try:
        check_choices(choices, limits, what=f"'{param}'")
    except GrammarError as exc:
        raise _bad(param, str(exc)) from exc
    return choice_grammar(choices)


def _openai(rf: Any) -> ResponseFormat | None:
    if not isinstance(rf, dict):
        raise _bad("response_format", "'response_format' must be an object with a 'type'")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise _bad(
                "response_format.json_schema",
                "'response_format.json_schema' must be an object with a 'schema' (and optional 'name', 'strict')",
            )
        schema = _schema_text(js["schema"], "response_format.json_schema.schema")
        return ResponseFormat("json_schema", schema=schema, strict=bool(js.get("strict") or False))
    raise _bad(
        "response_format.type",
        f"'response_format.type' {kind!r} is not supported (supported: 'text', 'json_object', 'json_schema')",
    )


def _vllm(fields: dict[str, Any], prefix: str, limits: GrammarLimits) -> list[tuple[str, ResponseFormat]]:
    """The formats named by vLLM-style keys (``prefix`` ``guided_`` or ``structured_outputs.``)."""
    out: list[tuple[str, ResponseFormat]] = []
    names = {"json": "json", "regex": "regex", "grammar": "grammar", "choice": "choice", "json_object": "json_object"}
    for key, what in names.items():
        value = fields.get(key)
        if value is None or value is False:
            continue
        param = f"{prefix}{key}"
        if what == "json":
            out.append((param, ResponseFormat("json_schema", schema=_schema_text(value, param))))
        elif what == "json_object":
            out.append((param, ResponseFormat("json_object")))
        elif what == "regex":
            if not isinstance(value, str):
                raise _bad(param, f"'{param}' must be a string")
            out.append((param, ResponseFormat("regex", pattern=value)))
        elif what == "grammar":
            if not isinstance(value, str):
                raise _bad(param, f"'{param}' must be a string")
            out.append((param, ResponseFormat("grammar", grammar=value)))
        else:
            out.append((param, ResponseFormat("grammar", grammar=_choice_grammar(value, param, limits))))
    return out


_FORMAT_KEYS = ("json", "regex", "grammar", "choice", "json_object")
_HINT_KEYS = ("disable_any_whitespace", "disable_fallback", "backend", "_backend")
"""vLLM ``structured_outputs`` keys that change nothing here: JSON is always compact, and
there is one engine (no fallback to choose)."""


def _check_structured_outputs_keys(fields: dict[str, Any]) -> None:
    """Refuse a ``structured_outputs`` key this server does not implement (vLLM's
    ``structural_tag``, ``whitespace_pattern``, ``disable_additional_properties``, an unknown
    one) unless it holds its default (None, False, empty): silently ignored, it would leave the
    output unconstrained or shaped otherwise than asked.

    Raises:
        OpenAIError: 400 ``unsupported_parameter`` naming the key.
    """
    for key, value in fields.items():
        if key in _FORMAT_KEYS or key in _HINT_KEYS or value is None or value is False or value in ("", [], {}):
            continue
        raise unsupported(
            f"structured_outputs.{key}",
            f"this server implements {', '.join(_FORMAT_KEYS)} (got {json.dumps(value)[:100]})",
        )


def response_format_of(body: Any, checker: TenantChecker | InlineChecker) -> common_pb2.ResponseFormat | None:
    """The request's structured-output format as a proto (None: unconstrained), compiled once to
    refuse a bad one early.

    Args:
        body: a parsed request (`schemas.SamplingFields`): ``response_format``, ``guided_json``,
            ``guided_regex``, ``guided_grammar``, ``guided_choice``, ``structured_outputs``.
        checker: compiles the format: the router's `GrammarChecker` (limits, then the engine,
            in a child process).

    Raises:
        OpenAIError: 400 naming the field: a malformed field, more than one format, or a
            schema / regex / grammar that does not compile.
    """
    found: list[tuple[str, ResponseFormat]] = []
    if body.response_format is not None:
        fmt = _openai(body.response_format)
        if fmt is not None:
            param = "response_format.json_schema.schema" if fmt.type == "json_schema" else "response_format"
            found.append((param, fmt))
    guided = {
        k[len("guided_") :]: getattr(body, k)
        for k in ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
    }
    found += _vllm(guided, "guided_", checker.limits)
    if body.structured_outputs is not None:
        if not isinstance(body.structured_outputs, dict):
            raise _bad("structured_outputs", "'structured_outputs' must be an object")
        _check_structured_outputs_keys(body.structured_outputs)
        found += _vllm(body.structured_outputs, "structured_outputs.", checker.limits)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"'{p}'" for p, _ in found)
        raise _bad(found[1][0], f"one structured-output format per request (got {names})")
    param, fmt = found[0]
    try:
        checker.check(fmt)
    except GrammarError as exc:
        raise _bad(param, f"invalid '{param}': {exc}") from exc
    return to_proto(fmt)


def to_proto(fmt: ResponseFormat) -> common_pb2.ResponseFormat:
    """The ``loraplane.v1.ResponseFormat`` of a runtime `ResponseFormat`."""
    return common_pb2.ResponseFormat(
        type=_PB_TYPE[fmt.type], schema=fmt.schema, strict=fmt.strict, regex=fmt.pattern, grammar=fmt.grammar
    )


__all__ = ["response_format_of", "to_proto"]
