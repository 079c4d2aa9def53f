"""Structured output's formats, torch-free: what a request's output must match
(`ResponseFormat`) and its llguidance grammar text (`compile_grammar`), checked without a
vocabulary. The control plane compiles every format here before routing (a bad one is
INVALID_ARGUMENT / HTTP 400 naming the fault); the worker binds the same grammar text to its
vocabulary and masks the logits (`worker.runtime.grammar`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import structlog

from loraplane.grammar_limits import (
    GrammarError,
    GrammarLimits,
    check_gbnf,
    check_lark,
    check_schema,
    check_text,
)

log = structlog.get_logger("loraplane.response_format")

KINDS = ("json_object", "json_schema", "regex", "grammar")

# The JSON compiler's options (llguidance ``JsonCompileOptions``): compact JSON (no whitespace
# between tokens; vLLM's ``disable_any_whitespace``), which keeps small models from looping on
# newlines, and ``oneOf`` treated as ``anyOf``.
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "coerce_one_of": True}


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Keywords whose value maps names to subschemas (the names are not keywords)."""
_VALUES = ("enum", "const", "default", "examples")
"""Keywords whose value is data, never a schema."""
_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
"""Keywords by which a schema says what its object admits beyond ``properties``."""


def close_objects(node: Any, *, listed_only: bool = False) -> Any:
    """The schema with ``"additionalProperties": false`` added to the object schemas that do not
    say what else they admit (no ``additionalProperties``, ``patternProperties`` or
    ``unevaluatedProperties``), recursively through properties, items, definitions and
    combinators.

    Args:
        node: a JSON Schema (dict) or any part of one.
        listed_only: close only the objects that list ``properties`` — the default of every
            ``json_schema`` format here (llama.cpp's ``json-schema-to-grammar``: an object's
            listed properties and no others, while a bare ``{"type": "object"}`` stays any
            object; vLLM's default backend closes objects likewise), so a small model cannot
            invent keys until ``max_tokens``. False: every object schema, bare ones included
            (OpenAI ``strict``).
    """
    if isinstance(node, list):
        return [close_objects(x, listed_only=listed_only) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _VALUES:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: close_objects(sub, listed_only=listed_only) for name, sub in value.items()}
        else:
            out[key] = close_objects(value, listed_only=listed_only)
    lists = "properties" in out
    if (lists or (not listed_only and out.get("type") == "object")) and not any(k in out for k in _OPENERS):
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class ResponseFormat:
    """What a request's output must match.

    Attributes:
        type: ``json_object`` (any JSON object), ``json_schema`` (``schema`` holds the JSON
            Schema text), ``regex`` (``pattern``, a Rust-regex-syntax expression matched against
            the whole output) or ``grammar`` (``grammar``, a Lark grammar, llguidance's native
            form; llama.cpp GBNF is converted with ``llguidance.gbnf_to_lark`` when it looks
            like GBNF, i.e. uses ``::=``).
        schema: JSON Schema text (``json_schema``).
        strict: OpenAI's ``strict``: every object schema admits no properties beyond those
            listed, bare ``{"type": "object"}`` ones included. Without it the objects that list
            ``properties`` are closed all the same (`close_objects`); a schema opens one with
            ``additionalProperties``.
        pattern: the regex (``regex``).
        grammar: the grammar text (``grammar``).
    """

    type: str
    schema: str = ""
    strict: bool = False
    pattern: str = ""
    grammar: str = ""

    @classmethod
    def from_proto(cls, rf: Any) -> ResponseFormat | None:
        """The format of a ``loraplane.v1.ResponseFormat`` message; None for TYPE_UNSPECIFIED
        (unconstrained). Unknown type numbers (a newer client) raise `GrammarError`."""
        if rf.type == 0:
            return None
        kind = _PROTO_TYPES.get(rf.type)
        if kind is None:
            raise GrammarError(f"response_format.type {rf.type} is not known to this server")
        return cls(kind, schema=rf.schema, strict=rf.strict, pattern=rf.regex, grammar=rf.grammar)


# ``loraplane.v1.ResponseFormat.Type`` numbers → `ResponseFormat.type`
_PROTO_TYPES = {1: "json_object", 2: "json_schema", 3: "regex", 4: "grammar"}


ENGINE_MESSAGE_CHARS = 512
"""Characters of the grammar engine's message a client sees (the rest is logged)."""


def one_line(msg: str) -> str:
    """The engine's message as a client sees it: on one line (its caret drawing folded), cut to
    `ENGINE_MESSAGE_CHARS`, without the parser state and grammar dump it appends to matcher
    errors (``<state>…``, ``<grammar>…``), and never a panic message or backtrace from the
    engine's internals (replaced by a plain sentence; the original is logged once). The engine
    marks a message without that dump ``<non-verbose/>``: cut too."""
    if "panicked at" in msg or "stack backtrace" in msg or "RUST_BACKTRACE" in msg:
        log.warning("grammar_engine_panic", message=msg[:4096])
        return "the grammar engine failed on this format (an internal error; see the server log)"
    for marker in ("<state>", "<grammar>", "<non-verbose/>"):
        cut = msg.find(marker)
        if cut >= 0:
            msg = msg[:cut]
    text = " ".join(part.strip() for part in msg.splitlines() if part.strip())
    if len(text) > ENGINE_MESSAGE_CHARS:
        text = text[: ENGINE_MESSAGE_CHARS - 1] + "…"
    return text


def engine_limits() -> Any:
    """The ``llguidance.LLParserLimits`` every validation and matcher uses: the engine's
    defaults, but without ``verbose_errors`` (the parser state and the whole grammar in every
    message: a 1 MB ``guided_choice`` list came back in its 400)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def _schema_obj(text: str, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except RecursionError:
        raise GrammarError(f"{what}: the JSON is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an integer past Python's int-str digit limit
        raise GrammarError(f"{what}: not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise GrammarError(f"{what}: a JSON Schema must be a JSON object, got {type(obj).__name__}")
    return obj


def json_schema_grammar(
    schema: dict[str, Any] | str, *, strict: bool = False, limits: GrammarLimits | None = None
) -> str:
    """The llguidance grammar (JSON text) of a JSON Schema: what tool-call constraints use too.

    Args:
        schema: the schema as a dict or JSON text.
        strict: OpenAI ``strict``: no properties beyond the listed ones in any object. Without
            it, objects that list ``properties`` and say nothing else are closed all the same
            (`close_objects` ``listed_only``): vLLM's and llama.cpp's default.
        limits: bounds checked before the engine sees the schema (default `GrammarLimits()`).

    Raises:
        GrammarError: the text is not JSON, not an object, over a limit (`LimitError`), or the
            engine rejects the schema.
    """
    import llguidance

    limits = limits or GrammarLimits()
    if isinstance(schema, str):
        check_text("json_schema", schema, limits)
        obj = _schema_obj(schema, "json_schema")
    else:
        obj = dict(schema)
    check_schema("json_schema", obj, limits)
    obj = close_objects(obj, listed_only=not strict)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(obj, defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
    except ValueError as exc:
        raise GrammarError(f"json_schema: {one_line(str(exc))}") from exc


def compile_grammar(fmt: ResponseFormat, limits: GrammarLimits | None = None) -> str:
    """The llguidance grammar text for ``fmt``, validated without a vocabulary (cheap enough for
    the control plane: no tokenizer needed). ``limits`` (default `GrammarLimits()`) are checked
    in Python before any engine code runs (`loraplane.grammar_limits`).

    Raises:
        GrammarError: unknown type, empty text, over a limit (`LimitError`, naming it and its
            flag), a schema / regex / grammar the engine rejects (the message names the type and
            carries the engine's reason).
    """
    import llguidance

    limits = limits or GrammarLimits()
    t = fmt.type
    if t == "json_object":
        g = json_schema_grammar({"type": "object"})
    elif t == "json_schema":
        if not fmt.schema.strip():
            raise GrammarError("json_schema: the schema is empty")
        g = json_schema_grammar(fmt.schema, strict=fmt.strict, limits=limits)
    elif t == "regex":
        if not fmt.pattern:
            raise GrammarError("regex: the pattern is empty")
        check_text("regex", fmt.pattern, limits)
        g = llguidance.LLMatcher.grammar_from_regex(fmt.pattern)
    elif t == "grammar":
        text = fmt.grammar
        if not text.strip():
            raise GrammarError("grammar: the grammar is empty")
        if "::=" in text:  # llama.cpp GBNF
            from llguidance.gbnf_to_lark import gbnf_to_lark

            check_gbnf("grammar", text, limits)
            try:
                text = gbnf_to_lark(text)
            except RecursionError:
                raise GrammarError("grammar: GBNF nested too deeply to convert to Lark") from None
            except Exception as exc:  # the converter raises plain exceptions on bad GBNF
                raise GrammarError(f"grammar: GBNF does not convert to Lark: {one_line(str(exc))}") from exc
        check_lark("grammar", text, limits, sized="::=" not in fmt.grammar)
        g = llguidance.LLMatcher.grammar_from_lark(text)
    else:
        raise GrammarError(f"response format type {t!r} is not supported (supported: {', '.join(KINDS)})")
    bad, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(g, None, limits=engine_limits())
    if bad:
        raise GrammarError(f"{t}: {one_line(msgs[0] if msgs else 'invalid')}")
    return g


def choice_grammar(choices: list[str]) -> str:
    """The Lark grammar matching exactly one of ``choices`` (vLLM ``guided_choice``): one
    terminal whose alternatives are the strings, so the engine's lexer matches them (one
    automaton) instead of its parser tracking one item per alternative (it refuses rows of more
    than 2 000 items, and a 100 000-item row cost minutes)."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)
