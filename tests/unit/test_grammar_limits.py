"""Structured-output bounds checked in Python before the grammar engine runs
(`loraplane.grammar_limits`), the engine's messages as clients see them, and the worker's
single-flight vocabulary view. Each crash shape here killed the process on main (SIGSEGV inside
the engine); now it is a `LimitError` naming the limit and its flag."""

from __future__ import annotations

import json
import threading
import time

import pytest

import worker.runtime.grammar as grammar
from control_plane.http.tools import check_tools
from loraplane.grammar_limits import GrammarLimits, LimitError, check_choices, lark_depth, lark_rules, schema_depth
from loraplane.response_format import ResponseFormat, choice_grammar, compile_grammar, one_line
from tests.helpers.grammar_bombs import defs_chain, gbnf_chain, lark_chain, refs_chain

DEFAULT = GrammarLimits()


@pytest.fixture
def tiny_tokenizer(fixtures_dir):
    """A fresh tokenizer object (the vocabulary view is cached per object)."""
    from loraplane.formats.gguf.reader import read_gguf
    from loraplane.formats.tokenizer import Tokenizer

    return Tokenizer.from_gguf(read_gguf(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"))


@pytest.fixture(scope="module")
def shared_tokenizer(fixtures_dir):
    """One tokenizer for the tests of the worker's compiled-format cache (its vocabulary view is
    built once for them)."""
    from loraplane.formats.gguf.reader import read_gguf
    from loraplane.formats.tokenizer import Tokenizer

    return Tokenizer.from_gguf(read_gguf(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"))


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        (
            ResponseFormat("json_schema", schema=json.dumps(defs_chain(1000))),
            "json_schema: the nesting depth through $refs is 3003, over the limit of 128 (--grammar-max-depth)",
        ),
        (
            ResponseFormat("json_schema", schema=json.dumps(refs_chain(5000))),
            "json_schema: the number of $defs/definitions is 5001, over the limit of 1024 (--grammar-max-rules)",
        ),
        (
            ResponseFormat("json_schema", schema=json.dumps(refs_chain(1000))),
            "json_schema: the nesting depth through $refs is 1003, over the limit of 128 (--grammar-max-depth)",
        ),
        (
            ResponseFormat("grammar", grammar=lark_chain(3000)),
            "grammar: the number of rules is more than 1024, over the limit of 1024 (--grammar-max-rules)",
        ),
        (
            ResponseFormat("grammar", grammar=lark_chain(500)),
            "grammar: the longest chain of rule references is 502, over the limit of 128 (--grammar-max-depth)",
        ),
        (
            ResponseFormat("grammar", grammar=gbnf_chain(5000)),
            "grammar: the number of GBNF rules is 5002, over the limit of 1024 (--grammar-max-rules)",
        ),
        (
            ResponseFormat("grammar", grammar="start: %json " + json.dumps(refs_chain(300))),
            "grammar: %json: the nesting depth through $refs is 303, over the limit of 128 (--grammar-max-depth)",
        ),
        (
            ResponseFormat("regex", pattern="a" * 300_000),
            "regex: the text is 300000 bytes, over the limit of 262144 bytes (--grammar-max-bytes)",
        ),
    ],
)
def test_crash_shapes_are_refused_before_the_engine_naming_the_limit(fmt, message):
    with pytest.raises(LimitError) as exc:
        compile_grammar(fmt)
    assert str(exc.value) == message


def test_real_formats_pass_the_default_limits():
    # a recursive schema (a tree), a pydantic-style schema with $defs, llama.cpp's JSON GBNF
    tree = {
        "$defs": {
            "node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
        },
        "$ref": "#/$defs/node",
    }
    person = {
        "$defs": {
            "Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            "Person": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Address"}},
                "required": ["name", "home"],
            },
        },
        "type": "array",
        "items": {"$ref": "#/$defs/Person"},
    }
    json_gbnf = (
        'root ::= object\nvalue ::= object | array | string | number | ("true" | "false" | "null") ws\n'
        'object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws\n'
        'array ::= "[" ws ( value ("," ws value)* )? "]" ws\n'
        'string ::= "\\"" ( [^"\\\\] )* "\\"" ws\nnumber ::= ("-"? [0-9]+) ws\nws ::= ([ \\t\\n] ws)?\n'
    )
    for fmt in (
        ResponseFormat("json_schema", schema=json.dumps(tree)),
        ResponseFormat("json_schema", schema=json.dumps(person), strict=True),
        ResponseFormat("grammar", grammar=json_gbnf),
        ResponseFormat("grammar", grammar=choice_grammar([f"label {i}" for i in range(1024)])),
    ):
        assert compile_grammar(fmt)
    # root, $defs, node, properties, kids, items → node again (on the path: a cycle adds nothing)
    assert schema_depth(tree) == 6
    # root, $defs, Person, properties, home → Address, properties, city
    assert schema_depth(person) == 8


def test_depth_walks_are_iterative_and_exact():
    assert schema_depth(refs_chain(20_000)) == 20_003  # no RecursionError at any length
    rules = lark_rules('start: a b\na: "x" | b\nb: C\nC: /[0-9]+/ // b\n%ignore " "', DEFAULT)
    assert rules == {"start": {"a", "b"}, "a": {"b"}, "b": {"C"}, "C": set()}
    assert lark_depth(rules) == 4  # start → a → b → C
    assert lark_depth(lark_rules('start: a\na: start "x" | "y"', DEFAULT)) == 2  # recursion: no loop


def test_choices_and_tools_are_bounded():
    with pytest.raises(LimitError, match=r"the number of choices is 1025, over the limit of 1024"):
        check_choices(["x"] * 1025, DEFAULT)
    with pytest.raises(LimitError, match=r"total size is 300000 bytes, over the limit of 262144 bytes"):
        check_choices(["y" * 1000] * 300, DEFAULT)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(Exception) as exc:
        check_tools([tool] * 129, "auto", max_tools=128)
    assert exc.value.status == 400 and exc.value.param == "tools"  # type: ignore[attr-defined]
    assert "'tools' has 129 entries, over the limit of 128 (--max-tools)" in str(exc.value)


def test_engine_messages_carry_no_state_dump_or_panic():
    dump = "Parser Error: Current row has 4001 items; max is 2000\n<state>\nTokens: x\n</state><grammar>\nstart: " + (
        '"a" | ' * 10_000
    )
    assert one_line(dump) == "Parser Error: Current row has 4001 items; max is 2000"
    terse = "lexer error: too many expressions constructed\n<non-verbose/>"  # a matcher's, non-verbose
    assert one_line(terse) == "lexer error: too many expressions constructed"
    panic = "thread '<unnamed>' panicked at src/lexer.rs:12:5:\nindex out of bounds\nstack backtrace:\n 0: ..."
    assert "panicked" not in one_line(panic) and "internal error" in one_line(panic)
    assert len(one_line("x" * 10_000)) == 512


@pytest.mark.slow  # builds a vocabulary view (about 0.5 s each)
def test_the_vocabulary_view_is_built_once_for_concurrent_first_requests(monkeypatch, tiny_tokenizer):
    builds: list[int] = []
    real = grammar._build_tokenizer

    def slow_build(tok, n_vocab):
        builds.append(1)
        time.sleep(0.3)  # a window in which every other caller arrives
        return real(tok, n_vocab)

    monkeypatch.setattr(grammar, "_build_tokenizer", slow_build)
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(grammar.grammar_tokenizer(tiny_tokenizer))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(got) == 4 and all(g is got[0] for g in got)


@pytest.mark.slow  # builds a vocabulary view (about 0.5 s each)
def test_a_failed_build_is_retried_by_the_next_caller(monkeypatch, tiny_tokenizer):
    real = grammar._build_tokenizer
    calls: list[int] = []

    def flaky(tok, n_vocab):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return real(tok, n_vocab)

    monkeypatch.setattr(grammar, "_build_tokenizer", flaky)
    with pytest.raises(RuntimeError, match="out of memory"):
        grammar.grammar_tokenizer(tiny_tokenizer)
    assert grammar.grammar_tokenizer(tiny_tokenizer) is not None and len(calls) == 2


@pytest.mark.slow  # builds a vocabulary view (about 0.5 s each)
def test_the_worker_refuses_over_its_limits_before_the_engine(tiny_tokenizer):
    with pytest.raises(LimitError, match=r"--grammar-max-depth"):
        grammar.Constraint.build(
            ResponseFormat("grammar", grammar=lark_chain(20)), tiny_tokenizer, None, GrammarLimits(max_depth=10)
        )
    c = grammar.Constraint.build(ResponseFormat("grammar", grammar=choice_grammar(["yes", "no"])), tiny_tokenizer)
    assert c.error is None and not c.done


@pytest.mark.slow  # starts child processes (about 1 s)
def test_the_checker_survives_a_crashing_child_and_kills_a_slow_one():
    from control_plane.grammar_check import GrammarChecker
    from loraplane.grammar_limits import GrammarError

    open_limits = GrammarLimits(max_depth=10**6, max_rules=10**6, max_bytes=10**8)
    bomb = ResponseFormat("json_schema", schema=json.dumps(refs_chain(5000)))
    with GrammarChecker(open_limits, processes=1, timeout_s=5) as checker:
        checker.check(ResponseFormat("json_object"))
        with pytest.raises(GrammarError, match=r"the grammar engine crashed on this format \(exit code -11\)"):
            checker.check(bomb)
        assert checker.crashes == 1
        checker.check(ResponseFormat("regex", pattern="[a-z]+"))  # a new child took over
        with pytest.raises(GrammarError, match=r"crashed"):
            checker.check(bomb)  # the verdict is remembered: no second crash
        assert checker.crashes == 1
        with pytest.raises(GrammarError, match=r"unclosed group"):
            checker.check(ResponseFormat("regex", pattern="(a"))
    with GrammarChecker(open_limits, processes=1, timeout_s=0.5) as checker:
        with pytest.raises(GrammarError, match=r"took longer than 0.5 s and was stopped \(--grammar-check-timeout\)"):
            checker.check(ResponseFormat("grammar", grammar=gbnf_chain(5000)))  # conversion takes seconds
        assert checker.timeouts == 1
        checker.check(ResponseFormat("json_object"))


def test_a_check_that_fails_otherwise_names_the_failure():
    from control_plane.grammar_check import _compile_in_child

    # what the child answers for a failure other than a refusal (was "the check did not finish")
    verdict = _compile_in_child(ResponseFormat("json_schema", schema=None), DEFAULT)  # type: ignore[arg-type]
    assert verdict == (
        "json_schema: the grammar check failed on this format "
        "(AttributeError: 'NoneType' object has no attribute 'strip')"
    )
    assert _compile_in_child(ResponseFormat("regex", pattern="[a-z]+"), DEFAULT) is None


def test_a_format_is_compiled_once_and_each_request_gets_its_own_matcher(monkeypatch, shared_tokenizer):
    # every request used to compile its format again: one costly format sent N times cost the
    # worker's two compile threads N compilations, and cheap formats queued behind them
    compiled: list[str] = []
    real = grammar.compile_grammar

    def counted(fmt, limits=None):
        compiled.append(fmt.type)
        time.sleep(0.05)  # concurrent first requests arrive while it compiles
        return real(fmt, limits)

    monkeypatch.setattr(grammar, "compile_grammar", counted)
    fmt = ResponseFormat("regex", pattern="ab|ba")
    built: list = []
    threads = [
        threading.Thread(target=lambda: built.append(grammar.Constraint.build(fmt, shared_tokenizer))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiled == ["regex"] and len(built) == 4
    again = grammar.Constraint.build(fmt, shared_tokenizer)
    assert compiled == ["regex"]
    # independent states: one request's tokens never move another's matcher
    a_id, b_id = (
        next(i for i in range(shared_tokenizer.n_vocab) if shared_tokenizer.token_bytes(i) == c) for c in (b"a", b"b")
    )
    assert built[0].advance(a_id) and built[0].advance(b_id) and built[0].matcher.is_accepting()
    assert [c.matcher.is_accepting() for c in [*built[1:], again]] == [False] * 4  # untouched
    assert built[1].advance(b_id) and built[1].advance(a_id) and built[1].matcher.is_accepting()
    assert again.advance(a_id) and not again.advance(a_id)  # "aa" is refused: its own state
    # a refusal is remembered too, with its class and message
    bad = ResponseFormat("grammar", grammar=lark_chain(20))
    for _ in range(2):
        with pytest.raises(LimitError, match=r"chain of rule references is 22, over the limit of 10"):
            grammar.Constraint.build(bad, shared_tokenizer, None, GrammarLimits(max_depth=10))
    assert compiled == ["regex", "grammar"]


@pytest.mark.slow  # child processes, one killed (about 2 s)
def test_concurrent_checks_of_one_format_share_one_child_and_one_verdict():
    from concurrent.futures import ThreadPoolExecutor

    from control_plane.grammar_check import GrammarChecker
    from loraplane.grammar_limits import GrammarError

    # 20 intersected patterns: about 30 s of the engine's emptiness check, stopped at 0.5 s.
    # Each identical request used to take a child of its own in turn (3 timeouts, 3 child
    # restarts), and under load some passed where others timed out: different verdicts.
    slow = {"allOf": [{"type": "string", "pattern": f".*{c}.*"} for c in "abcdefghijklmnopqrst"]}
    fmt = ResponseFormat("json_schema", schema=json.dumps(slow))

    def verdict() -> str:
        try:
            checker.check(fmt)
        except GrammarError as exc:
            return str(exc)
        return "compiled"

    with GrammarChecker(DEFAULT, processes=1, timeout_s=0.5) as checker:
        checker.check(ResponseFormat("json_object"))  # the child is up
        with ThreadPoolExecutor(3) as pool:
            verdicts = list(pool.map(lambda _: verdict(), range(3)))
        assert checker.timeouts == 1
        stopped = "json_schema: compiling it took longer than 0.5 s and was stopped (--grammar-check-timeout)"
        assert verdicts == [f"{stopped}; simplify the format"] * 3


def test_kept_matchers_are_bounded_by_their_formats_size(monkeypatch, shared_tokenizer):
    compiled: list[str] = []
    real = grammar.compile_grammar

    def counted(fmt, limits=None):
        compiled.append(fmt.pattern)
        return real(fmt, limits)

    monkeypatch.setattr(grammar, "compile_grammar", counted)
    monkeypatch.setattr(grammar, "MATCHER_CACHE_BYTES", 2 * 1000 + 100)  # two of the formats below
    big = [ResponseFormat("regex", pattern=f"{c}{'x' * 994}") for c in ("a", "b", "c")]  # 1 000 bytes each
    for fmt in big:
        grammar.Constraint.build(fmt, shared_tokenizer)
    grammar.Constraint.build(big[2], shared_tokenizer)
    grammar.Constraint.build(big[1], shared_tokenizer)
    assert len(compiled) == 3  # the last two were kept
    grammar.Constraint.build(big[0], shared_tokenizer)
    assert len(compiled) == 4 and compiled[-1] == big[0].pattern  # the first was not: a third over the budget


@pytest.mark.slow  # child processes and checks that run to a 1 s timeout (about 4 s)
def test_one_tenants_slow_checks_never_hold_every_child():
    import concurrent.futures

    from control_plane.grammar_check import GrammarChecker
    from loraplane.grammar_limits import GrammarError

    open_limits = GrammarLimits(max_depth=10**6, max_rules=10**6, max_bytes=10**8)
    with GrammarChecker(open_limits, processes=2, timeout_s=1.0) as checker:
        checker.check(ResponseFormat("json_object"))  # both children started
        checker.check(ResponseFormat("regex", pattern="[0-9]+"))
        slow = [ResponseFormat("grammar", grammar=gbnf_chain(5000 + i)) for i in range(3)]  # seconds each to convert
        done: dict[str, float] = {}

        def heavy(fmt: ResponseFormat) -> None:
            with pytest.raises(GrammarError, match="took longer than 1 s"):
                checker.for_tenant("heavy").check(fmt)
            done.setdefault("heavy_all", 0.0)
            done["heavy_all"] = time.monotonic()

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            futures = [ex.submit(heavy, f) for f in slow]
            time.sleep(0.2)
            checker.for_tenant("light").check(ResponseFormat("regex", pattern="[a-z]{3}"))
            done["light"] = time.monotonic()
            for f in futures:
                f.result()
        # the heavy tenant's three checks ran one at a time in its lane (about 3 s); the light
        # tenant's check took the other child at once
        assert done["heavy_all"] - t0 >= 2.5
        assert done["light"] < done["heavy_all"] - 1.0
