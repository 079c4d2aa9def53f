"""Structured output's formats, torch-free: what a request's output must match
(`ResponseFormat`) and its llguidance grammar text (`compile_grammar`), checked without a
vocabulary. The control plane compiles every format here before routing (a bad one is
INVALID_ARGUMENT / HTTP 400 naming the fault); the worker binds the same grammar text to its
vocabulary and masks the logits (`loraplane.worker.runtime.grammar`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_object", "json_schema", "regex", "grammar")

# The JSON compiler's options (llguidance ``JsonCompileOptions``): compact JSON (no whitespace
# between tokens; vLLM's ``disable_any_whitespace``), which keeps small models from looping on
# newlines, and ``oneOf`` treated as ``anyOf``.
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "coerce_one_of": True}


def close_objects(node: Any) -> Any:
    """OpenAI ``strict``: every object schema without ``additionalProperties`` gets ``false``
    (recursively through properties, items, definitions and combinators)."""
    if isinstance(node, list):
        return [close_objects(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: close_objects(v) if k not in ("enum", "const", "default", "examples") else v for k, v in node.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GrammarError(ValueError):
    """A response format that does not compile (names the format and the engine's message)."""


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
        strict: OpenAI's ``strict``: objects admit no properties beyond those listed.
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


def one_line(msg: str) -> str:
    """The engine's multi-line message (with its caret drawing) on one line."""
    return " ".join(part.strip() for part in msg.splitlines() if part.strip())


def _schema_obj(text: str, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"{what}: not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise GrammarError(f"{what}: a JSON Schema must be a JSON object, got {type(obj).__name__}")
    return obj


def json_schema_grammar(schema: dict[str, Any] | str, *, strict: bool = False) -> str:
    """The llguidance grammar (JSON text) of a JSON Schema: what tool-call constraints use too.

    Args:
        schema: the schema as a dict or JSON text.
        strict: OpenAI ``strict``: no properties beyond the listed ones in any object.

    Raises:
        GrammarError: the text is not JSON, not an object, or the engine rejects the schema.
    """
    import llguidance

    obj = _schema_obj(schema, "json_schema") if isinstance(schema, str) else dict(schema)
    if strict:
        obj = close_objects(obj)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(obj, defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
    except ValueError as exc:
        raise GrammarError(f"json_schema: {exc}") from exc


def compile_grammar(fmt: ResponseFormat) -> str:
    """The llguidance grammar text for ``fmt``, validated without a vocabulary (cheap enough for
    the control plane: no tokenizer needed).

    Raises:
        GrammarError: unknown type, empty text, a schema / regex / grammar the engine rejects
            (the message names the type and carries the engine's reason).
    """
    import llguidance

    t = fmt.type
    if t == "json_object":
        g = json_schema_grammar({"type": "object"})
    elif t == "json_schema":
        if not fmt.schema.strip():
            raise GrammarError("json_schema: the schema is empty")
        g = json_schema_grammar(fmt.schema, strict=fmt.strict)
    elif t == "regex":
        if not fmt.pattern:
            raise GrammarError("regex: the pattern is empty")
        g = llguidance.LLMatcher.grammar_from_regex(fmt.pattern)
    elif t == "grammar":
        text = fmt.grammar
        if not text.strip():
            raise GrammarError("grammar: the grammar is empty")
        if "::=" in text:  # llama.cpp GBNF
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = gbnf_to_lark(text)
            except Exception as exc:  # the converter raises plain exceptions on bad GBNF
                raise GrammarError(f"grammar: GBNF does not convert to Lark: {exc}") from exc
        g = llguidance.LLMatcher.grammar_from_lark(text)
    else:
        raise GrammarError(f"response format type {t!r} is not supported (supported: {', '.join(KINDS)})")
    bad, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(g, None)
    if bad:
        raise GrammarError(f"{t}: {one_line(msgs[0] if msgs else 'invalid')}")
    return g
