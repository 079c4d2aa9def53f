"""Structured-output formats that overflowed the grammar engine's native stack (SIGSEGV) before
the limits of `loraplane.grammar_limits` existed: what the limit and isolation tests send."""

from __future__ import annotations


def defs_chain(n: int) -> dict:
    """1 000 object ``$defs`` each ``$ref``-ing the next through a property (75 KB)."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def refs_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: r{i + 1} "a"' for i in range(n)) + f'\nr{n}: "b"'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} "a"' for i in range(n)) + f'\nr{n} ::= "b"'
