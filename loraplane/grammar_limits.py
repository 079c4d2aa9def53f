"""Bounds on structured-output formats, checked in Python before any grammar engine code runs.

The grammar library (llguidance) resolves ``$ref`` chains and rule references recursively on the
native stack: a flat 75 KB JSON Schema of 1 000 ``$defs`` that each ``$ref`` the next, a Lark
grammar of 3 000 chained rules or 5 000 GBNF rules overflow an 8 MiB stack and kill the process
(SIGSEGV), and its own size limits come too late to help. `check_limits` measures what drives
that recursion (the longest chain of nested schemas and ``$ref`` hops, of rule references), the
counts (``$defs``, rules, choices, tools) and the text sizes, with iterative walks of its own,
and refuses a format over a `GrammarLimits` bound with a `GrammarError` that names the limit and
its flag. The control plane runs it (and the engine's own validation) in a child process as well
(`control_plane.grammar_check`); the worker runs it before it builds a matcher.

Measured on llguidance 1.9 with an 8 MiB stack (the chains that crash): ``$ref`` hops alone
2 000-3 000; objects whose property ``$ref``-s the next 700-1 000 (about 2 000 nested schema
objects on the path); Lark rules referencing the next 2 000-3 000. Inline nesting is already
refused by the engine's JSON parser at 128 levels. The default depth bound, 128, is 15x below
the smallest crash and above what real schemas and grammars reach (tens).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GrammarError",
    "GrammarLimits",
    "LimitError",
    "check_choices",
    "check_gbnf",
    "check_lark",
    "check_schema",
    "check_text",
    "lark_depth",
    "schema_depth",
]


class GrammarError(ValueError):
    """A response format that does not compile (names the format and the engine's message)."""


class LimitError(GrammarError):
    """A structured-output format over one of the `GrammarLimits` bounds (names the limit, its
    value and its flag)."""


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on one request's structured-output format (each one a server flag).

    Attributes:
        max_bytes: UTF-8 bytes of a schema, regex or grammar text, and of a ``guided_choice``
            list's strings together (``--grammar-max-bytes``; default 256 KiB: the largest real
            schemas, OpenAPI-derived tool sets, are tens of KiB).
        max_depth: the longest chain of nested schema objects, following each ``$ref`` into its
            target, in a JSON Schema; the longest chain of rule/terminal references in a Lark or
            GBNF grammar (``--grammar-max-depth``; default 128, module docstring).
        max_rules: ``$defs`` / ``definitions`` entries of a JSON Schema; rule and terminal
            definitions of a Lark grammar, or ``::=`` rules of a GBNF one
            (``--grammar-max-rules``; default 1 024; GBNF's conversion to Lark grows faster than
            linearly: 1 000 rules take about 1 s).
        max_choices: strings in a ``guided_choice`` list (``--grammar-max-choices``; default
            1 024, OpenAI's bound on enum values in a strict schema is of the same order).
        max_tools: entries of a chat request's ``tools`` (``--max-tools``; default 128, OpenAI's
            own bound).
    """

    max_bytes: int = 256 * 1024
    max_depth: int = 128
    max_rules: int = 1024
    max_choices: int = 1024
    max_tools: int = 128

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_depth", "max_rules", "max_choices", "max_tools"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GrammarLimits.{name} must be an integer >= 1, got {value!r}")


FLAGS = {
    "max_bytes": "--grammar-max-bytes",
    "max_depth": "--grammar-max-depth",
    "max_rules": "--grammar-max-rules",
    "max_choices": "--grammar-max-choices",
    "max_tools": "--max-tools",
}
"""The server flag of each `GrammarLimits` field (named in every refusal)."""


def over(what: str, found: int, limits: GrammarLimits, field: str, *, more: bool = False, unit: str = "") -> LimitError:
    """The refusal of ``what`` (``found`` > ``limits.<field>``, in ``unit``); ``more``: ``found``
    is a lower bound (the walk stopped at the limit)."""
    bound = getattr(limits, field)
    count = f"more than {bound}" if more else str(found)
    return LimitError(f"{what} is {count}{unit}, over the limit of {bound}{unit} ({FLAGS[field]})")


def check_text(what: str, text: str, limits: GrammarLimits) -> None:
    """``text`` (a schema / regex / grammar) within ``limits.max_bytes`` UTF-8 bytes.

    Raises:
        LimitError: it is longer (names ``what``).
    """
    # a cheap bound first: a str of n code points is at most 4n UTF-8 bytes, at least n
    if len(text) * 4 <= limits.max_bytes:
        return
    n = len(text.encode("utf-8", "surrogatepass"))
    if n > limits.max_bytes:
        raise over(f"{what}: the text", n, limits, "max_bytes", unit=" bytes")


def check_choices(choices: list[str], limits: GrammarLimits, what: str = "guided_choice") -> None:
    """A ``guided_choice`` list within ``limits`` (count, then total UTF-8 bytes).

    Raises:
        LimitError: too many strings, or too many bytes together (names ``what``).
    """
    if len(choices) > limits.max_choices:
        raise over(f"{what}: the number of choices", len(choices), limits, "max_choices")
    total = sum(len(c.encode("utf-8", "surrogatepass")) for c in choices)
    if total > limits.max_bytes:
        raise over(f"{what}: the choices' total size", total, limits, "max_bytes", unit=" bytes")


# ------------------------------------------------------------------------------ JSON Schema


def _pointer(root: Any, ref: str) -> Any:
    """The node a local ``$ref`` (``#``, ``#/a/b~1c/0``) points to in ``root``; None for remote
    refs, anchors and pointers that lead nowhere (the engine reports those itself)."""
    if not ref.startswith("#"):
        return None
    node = root
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, (dict, list)) else None


def _children(node: Any) -> Iterator[Any]:
    values: Iterable[Any] = node.values() if isinstance(node, dict) else node
    for v in values:
        if isinstance(v, (dict, list)):
            yield v


def _longest_chain(roots: list[Any], edges: Callable[[Any], Iterable[Any]], weight: Callable[[Any], int]) -> int:
    """The largest total ``weight`` along a path of ``edges`` from any of ``roots``, each node
    counted at its first visit (a depth-first walk with memo, as a recursive resolver that
    remembers what it resolved goes; a node already on the path, a cycle, adds nothing).
    Iterative: the chains it measures are those too long for recursion."""
    memo: dict[int, int] = {}
    on_path: set[int] = set()
    best = 0
    for root in roots:
        if id(root) in memo:
            best = max(best, memo[id(root)])
            continue
        stack: list[tuple[Any, Iterator[Any], int]] = [(root, iter(edges(root)), 0)]
        on_path.add(id(root))
        while stack:
            node, it, deepest = stack[-1]
            child = next(it, None)
            if child is None:
                stack.pop()
                on_path.discard(id(node))
                total = weight(node) + deepest
                memo[id(node)] = total
                if stack:
                    parent, pit, pdeep = stack[-1]
                    stack[-1] = (parent, pit, max(pdeep, total))
                else:
                    best = max(best, total)
                continue
            key = id(child)
            if key in on_path:
                continue
            if key in memo:
                stack[-1] = (node, it, max(deepest, memo[key]))
                continue
            on_path.add(key)
            stack.append((child, iter(edges(child)), 0))
    return best


def schema_depth(schema: Any) -> int:
    """The longest chain of nested schema objects in ``schema`` (a parsed JSON Schema),
    following each local ``$ref`` into its target: the recursion a resolver goes through.
    Arrays (``anyOf`` lists, ``enum`` values) add no level; objects do."""

    def edges(node: Any) -> Iterator[Any]:
        yield from _children(node)
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            target = _pointer(schema, node["$ref"])
            if target is not None:
                yield target

    return _longest_chain([schema], edges, lambda n: 1 if isinstance(n, dict) else 0)


def _count_defs(schema: Any) -> int:
    """``$defs`` / ``definitions`` entries at every level of ``schema``."""
    n = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("$defs", "definitions"):
                if isinstance(node.get(key), dict):
                    n += len(node[key])
        stack.extend(_children(node))
    return n


def check_schema(what: str, schema: Any, limits: GrammarLimits) -> None:
    """A parsed JSON Schema within ``limits``: ``$defs`` count, nesting through ``$ref``s.

    Raises:
        LimitError: over a bound (names ``what`` and the limit).
    """
    n = _count_defs(schema)
    if n > limits.max_rules:
        raise over(f"{what}: the number of $defs/definitions", n, limits, "max_rules")
    depth = schema_depth(schema)
    if depth > limits.max_depth:
        raise over(f"{what}: the nesting depth through $refs", depth, limits, "max_depth")


# ------------------------------------------------------------------------------ Lark / GBNF

# What carries no rule reference in a Lark grammar: string literals (with the ``i`` flag),
# regex literals, comments; and the start of an embedded JSON object (``%json {…}``, …).
_LARK_SKIP = re.compile(
    r'"(?:[^"\\\n]|\\.)*"i?'  # "string"
    r"|/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*"  # /regex/flags
    r"|//[^\n]*"  # // comment
    r"|%(?:json|regex|llguidance)\b\s*(?=[{\[])"  # %json {…}: the JSON follows
)
_DEFINITION = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?\s*(?:\{[^}]*\})?\s*:(?!:)")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _blank_lark(text: str, limits: GrammarLimits, what: str) -> str:
    """``text`` with literals, comments and embedded JSON replaced by spaces (newlines kept);
    each embedded ``%json`` schema is checked with `check_schema` on the way."""
    out: list[str] = []
    pos = 0
    decoder = json.JSONDecoder()
    while True:
        m = _LARK_SKIP.search(text, pos)
        if m is None:
            out.append(text[pos:])
            return "".join(out)
        out.append(text[pos : m.start()])
        end = m.end()
        if m.group(0).startswith("%"):
            try:
                value, end = decoder.raw_decode(text, m.end())
            except RecursionError:
                raise over(
                    f"{what}: embedded JSON nesting", limits.max_depth + 1, limits, "max_depth", more=True
                ) from None
            except ValueError:
                end = m.end()  # not JSON: the engine reports it
            else:
                if m.group(0).startswith("%json"):
                    check_schema(f"{what}: %json", value, limits)
        out.append("".join(c if c == "\n" else " " for c in text[m.start() : end]))
        pos = end


def lark_rules(text: str, limits: GrammarLimits, what: str = "grammar") -> dict[str, set[str]]:
    """The rule and terminal definitions of a Lark grammar and the names each body refers to.

    Raises:
        LimitError: more definitions than ``limits.max_rules``, or an embedded ``%json`` schema
            over a bound.
    """
    rules: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in _blank_lark(text, limits, what).split("\n"):
        stripped = line.lstrip()
        if not stripped or stripped.startswith("%"):
            current = None if stripped.startswith("%") else current
            continue
        m = _DEFINITION.match(line)
        if m is not None:
            current = rules.setdefault(m.group(1), set())
            if len(rules) > limits.max_rules:
                raise over(f"{what}: the number of rules", len(rules), limits, "max_rules", more=True)
            body = line[m.end() :]
        elif current is not None:
            body = line
        else:
            continue
        current.update(_IDENT.findall(body))
    return rules


def lark_depth(rules: dict[str, set[str]]) -> int:
    """The longest chain of references between the defined rules/terminals of `lark_rules`."""
    names = list(rules)
    nodes = {name: [name] for name in names}  # one unique object per name, for the walk's ids

    def edges(node: list[str]) -> Iterator[list[str]]:
        for ref in rules[node[0]]:
            if ref in nodes:
                yield nodes[ref]

    return _longest_chain([nodes[n] for n in names], edges, lambda _n: 1)


def check_lark(what: str, text: str, limits: GrammarLimits, *, sized: bool = True) -> None:
    """A Lark grammar within ``limits``: size (unless ``sized`` is False: a conversion's output,
    whose source was sized), rule count, reference-chain depth, embedded ``%json`` schemas.

    Raises:
        LimitError: over a bound (names ``what`` and the limit).
    """
    if sized:
        check_text(what, text, limits)
    depth = lark_depth(lark_rules(text, limits, what))
    if depth > limits.max_depth:
        raise over(f"{what}: the longest chain of rule references", depth, limits, "max_depth")


def check_gbnf(what: str, text: str, limits: GrammarLimits) -> None:
    """GBNF text within ``limits`` before it is converted to Lark: size and rule count (the
    conversion's cost grows faster than linearly with the rules).

    Raises:
        LimitError: over a bound.
    """
    check_text(what, text, limits)
    n = text.count("::=")
    if n > limits.max_rules:
        raise over(f"{what}: the number of GBNF rules", n, limits, "max_rules")
