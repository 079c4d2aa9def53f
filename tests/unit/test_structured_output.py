"""Structured output plumbing: grammar compile errors, bitmasks on a tiny vocabulary, the mask
step touching only constrained rows, the scheduler's per-row constraint in a mixed-adapter batch
(tiny MoE model, in process), and the HTTP parsing of ``response_format`` / ``guided_*``."""

from __future__ import annotations

import json
import queue
import threading

import pytest
import torch

from control_plane.grammar_check import InlineChecker
from control_plane.http.errors import OpenAIError
from control_plane.http.schemas import ChatCompletionRequest, CompletionRequest
from control_plane.http.structured import response_format_of
from loraplane.adapter_scales import NO_ADAPTERS, AdapterScales
from loraplane.formats.tokenizer import TokenAttr
from loraplane.v1 import common_pb2
from worker.config import Batching, PrefixCachePolicy, WorkerConfig
from worker.errors import InvalidRequestError
from worker.runtime.grammar import (
    Constraint,
    GrammarError,
    ResponseFormat,
    apply_masks,
    compile_grammar,
    fill_masks,
    mask_words,
)
from worker.runtime.sampling import SamplingParams
from worker.serving.constraints import GrammarStage
from worker.serving.engine import WorkerEngine
from worker.serving.request import ErrorEvent, FinishedEvent, TokenEvent

WORDS = ["{", "}", '"', ":", ",", "true", "false", "ok", "n", '{"', '":', "yes", "no", " "]


class TinyTok:
    """A 256 + len(WORDS) + 2-token vocabulary: every byte, some JSON pieces, BOS and EOS
    (control), shaped like `loraplane.formats.tokenizer.Tokenizer` for the grammar module."""

    def __init__(self) -> None:
        self._pieces = [f"<0x{b:02X}>" for b in range(256)] + WORDS + ["<s>", "</s>"]
        self.n_vocab = len(self._pieces)
        self.bos_id, self.eos_id = self.n_vocab - 2, self.n_vocab - 1
        self.eog_ids = frozenset({self.eos_id})
        self.vocab_type = "gpt2"  # no SentencePiece space prefix
        self._attrs = [TokenAttr.BYTE] * 256 + [TokenAttr.NORMAL] * len(WORDS) + [TokenAttr.CONTROL] * 2

    def token_bytes(self, i: int, skip_special: bool = True) -> bytes:
        return bytes([i]) if i < 256 else self._pieces[i].encode()

    def encode(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        return list(text.encode())

    def id_of(self, piece: str) -> int:
        return self._pieces.index(piece)


@pytest.fixture(scope="module")
def tiny() -> TinyTok:
    return TinyTok()


def allowed(masks: torch.Tensor, row: int, n_vocab: int) -> set[int]:
    return {t for t in range(n_vocab) if (int(masks[row, t // 32]) >> (t % 32)) & 1}


def test_schema_text_past_the_decoders_limits_is_refused_by_name():
    # the gRPC path (and the worker) read the schema text here: a ValueError, not a GrammarError,
    # left the control plane's check child with "the check did not finish"
    big = ResponseFormat("json_schema", schema='{"type": "integer", "maximum": ' + "9" * 5000 + "}")
    with pytest.raises(GrammarError, match=r"^json_schema: not valid JSON: Exceeds the limit \(4300 digits\)"):
        compile_grammar(big)
    with pytest.raises(GrammarError, match=r"^json_schema: the JSON is nested too deeply$"):
        compile_grammar(ResponseFormat("json_schema", schema="[" * 100_000 + "]" * 100_000))


def test_bad_formats_name_the_fault():
    with pytest.raises(GrammarError, match="json_schema: not valid JSON"):
        compile_grammar(ResponseFormat("json_schema", schema="{"))
    with pytest.raises(GrammarError, match="json_schema: .*foo"):
        compile_grammar(ResponseFormat("json_schema", schema='{"type": "foo"}'))
    with pytest.raises(GrammarError, match="regex: .*unclosed group"):
        compile_grammar(ResponseFormat("regex", pattern="(a"))
    with pytest.raises(GrammarError, match='grammar: .*unknown name: "nope"'):
        compile_grammar(ResponseFormat("grammar", grammar="start: nope"))
    with pytest.raises(GrammarError, match="'xml' is not supported"):
        compile_grammar(ResponseFormat("xml"))
    # GBNF (llama.cpp) is converted to Lark
    assert '"yes"' in compile_grammar(ResponseFormat("grammar", grammar='root ::= "yes" | "no"'))


def test_masks_follow_the_grammar_and_end_with_eos(tiny):
    c = Constraint.build(ResponseFormat("grammar", grammar='start: "yes" | "no"'), tiny)
    buf = torch.zeros((2, mask_words(tiny.n_vocab)), dtype=torch.int32)
    fill_masks([c], buf)
    first = allowed(buf, 0, tiny.n_vocab)
    assert {tiny.id_of("yes"), tiny.id_of("no"), ord("y"), ord("n")} <= first
    assert tiny.id_of("ok") not in first and tiny.eos_id not in first and ord("x") not in first
    assert c.advance(tiny.id_of("no"))
    assert c.done  # complete and nothing else allowed: the scheduler ends the request
    fill_masks([c], buf)
    assert allowed(buf, 0, tiny.n_vocab) == {tiny.eos_id}
    assert not c.advance(ord("x")) and c.error


def test_apply_masks_touches_only_the_constrained_rows(tiny):
    a = Constraint.build(ResponseFormat("regex", pattern="[0-9]+"), tiny)
    b = Constraint.build(ResponseFormat("json_object"), tiny)
    buf = torch.zeros((2, mask_words(tiny.n_vocab)), dtype=torch.int32)
    fill_masks([a, b], buf)
    logits = torch.randn(4, tiny.n_vocab)
    before = logits.clone()
    apply_masks(logits, [3, 1], buf)  # mask row 0 → logits row 3, mask row 1 → logits row 1
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    digits = {ord(d) for d in "0123456789"}
    assert {t for t in range(tiny.n_vocab) if logits[3, t] > float("-inf")} == digits
    assert torch.equal(logits[3, sorted(digits)], before[3, sorted(digits)])
    finite1 = {t for t in range(tiny.n_vocab) if logits[1, t] > float("-inf")}
    assert (
        finite1 == allowed(buf, 1, tiny.n_vocab)
        and finite1
        and finite1 == {ord("{"), tiny.id_of("{"), tiny.id_of('{"')}
    )


def _after(fmt, text, tiny):
    """The tokens ``fmt`` allows after the bytes of ``text`` (the tiny vocabulary's byte tokens)."""
    c = Constraint.build(fmt, tiny)
    for t in text:
        assert c.advance(ord(t)), text
    buf = torch.zeros((1, mask_words(tiny.n_vocab)), dtype=torch.int32)
    fill_masks([c], buf)
    return allowed(buf, 0, tiny.n_vocab)


def test_listed_objects_are_closed_strict_or_not(tiny):
    """An object that lists ``properties`` admits no other key with or without ``strict``
    (llama.cpp's and vLLM's default); ``additionalProperties: true`` opens it again."""
    listed = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for strict in (False, True):
        fmt = ResponseFormat("json_schema", schema=json.dumps(listed), strict=strict)
        assert _after(fmt, '{"ok":true', tiny) == {ord("}")}
    opened = ResponseFormat("json_schema", schema=json.dumps({**listed, "additionalProperties": True}))
    assert ord(",") in _after(opened, '{"ok":true', tiny)  # another key may follow


def test_strict_closes_bare_objects_too(tiny):
    """A bare ``{"type": "object"}`` stays any object without ``strict`` (llama.cpp's rule) and is
    ``{}`` with it (OpenAI ``strict``)."""
    schema = json.dumps({"type": "object", "properties": {"o": {"type": "object"}}, "required": ["o"]})
    loose = _after(ResponseFormat("json_schema", schema=schema), '{"o":{', tiny)
    assert ord('"') in loose and ord("}") in loose  # a key may start
    assert _after(ResponseFormat("json_schema", schema=schema, strict=True), '{"o":{', tiny) == {ord("}")}


def test_close_objects_leaves_data_and_property_names_alone():
    from loraplane.response_format import close_objects

    schema = {
        "type": "object",
        "properties": {"properties": {"type": "string", "enum": [{"properties": 1}]}, "m": {"type": "object"}},
        "$defs": {"p": {"properties": {"a": {}}}},
        "patternProperties": {"^x": {"type": "integer"}},
    }
    assert close_objects(schema, listed_only=True) == {
        "type": "object",
        "properties": {"properties": {"type": "string", "enum": [{"properties": 1}]}, "m": {"type": "object"}},
        "$defs": {"p": {"properties": {"a": {}}, "additionalProperties": False}},
        "patternProperties": {"^x": {"type": "integer"}},  # says what else it admits: left open
    }
    assert close_objects(schema)["properties"]["m"] == {"type": "object", "additionalProperties": False}


def test_grammar_stage_finishes_a_complete_grammar(tiny):
    from worker.serving.request import GenRequest

    stage = GrammarStage(tiny.n_vocab, 2)
    req = GenRequest.__new__(GenRequest)
    req.request_id = "r"
    req.constraint = Constraint.build(ResponseFormat("grammar", grammar='start: "yes" | "no"'), tiny)
    pending = stage.start([req])
    logits = torch.zeros(1, tiny.n_vocab)
    stage.apply(pending, logits, {id(req): 0})
    assert int(torch.argmax(logits)) in {tiny.id_of("yes"), tiny.id_of("no"), ord("y"), ord("n")}
    assert stage.advance(req, tiny.id_of("yes"), None) == "stop"
    assert stage.advance(req, tiny.id_of("yes"), "length") == "length"  # refused, logged, never raised
    stage.close()


# ---------------------------------------------------------------------------- scheduler


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(fixtures_dir):
    e = WorkerEngine(
        WorkerConfig(
            model_path=str(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"),
            n_seqs=6,
            batching=Batching.MIXED,
            prefix_cache=PrefixCachePolicy.LLAMA,
            device="cpu",
            n_ctx_seq=256,
        )
    )
    e.load_adapter(0, path=str(fixtures_dir / "tiny_moe" / "moe_lora.gguf"))
    yield e
    e.close()


def _run_batch(engine: WorkerEngine, specs: list[tuple[str, SamplingParams, list]]) -> dict[str, list]:
    """Submit ``specs`` while the loop is held (one batch from the first step); events per id."""
    q: queue.Queue = queue.Queue()
    gate = threading.Event()
    engine.scheduler.run_soon(lambda: gate.wait(30))
    try:
        for rid, params, entries in specs:
            engine.submit(
                request_id=rid,
                prompt_tokens=[1, 450, 4996, 17354],
                prompt_text=None,
                params=params,
                adapters=AdapterScales(entries),
                emit=lambda ev, rid=rid: q.put((rid, ev)),
            )
    finally:
        gate.set()
    out: dict[str, list] = {rid: [] for rid, _, _ in specs}
    done = 0
    while done < len(specs):
        rid, ev = q.get(timeout=120)
        out[rid].append(ev)
        done += isinstance(ev, FinishedEvent | ErrorEvent)
    return out


def _ids(evs: list) -> list[int]:
    return [ev.token_id for ev in evs if isinstance(ev, TokenEvent)]


@pytest.mark.slow  # the tiny model for ~10 steps, twice
def test_constrained_rows_in_a_mixed_adapter_batch(engine):
    fmt = ResponseFormat("json_schema", schema=json.dumps(SCHEMA))
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    specs = [
        ("json-base", SamplingParams(max_tokens=40, response_format=fmt), []),
        ("json-lora", SamplingParams(max_tokens=40, response_format=fmt), [(0, 1.0)]),
        ("json-sampled", SamplingParams(max_tokens=40, temperature=1.0, seed=7, response_format=fmt), [(0, 0.5)]),
        ("regex", SamplingParams(max_tokens=40, response_format=ResponseFormat("regex", pattern="[ab]{3}")), []),
        ("free-base", plain, []),
        ("free-lora", plain, [(0, 1.0)]),
    ]
    out = _run_batch(engine, specs)
    for rid in ("json-base", "json-lora", "json-sampled"):
        fin = out[rid][-1]
        assert isinstance(fin, FinishedEvent), fin
        assert fin.finish_reason == "stop", fin.text
        doc = json.loads(fin.text)
        assert set(doc) == {"ok", "n"} and isinstance(doc["ok"], bool) and doc["n"] in range(10), doc
        steps = [ev.step for ev in out[rid] if isinstance(ev, TokenEvent)]
        assert max(s.n_adapter_sets for s in steps) >= 2  # shared a batch with other adapter sets
    assert out["regex"][-1].finish_reason == "stop" and out["regex"][-1].text in {
        a + b + c for a in "ab" for b in "ab" for c in "ab"
    }
    # unconstrained rows are untouched: the same tokens as when they run without constrained rows
    alone = _run_batch(engine, [("free-base", plain, []), ("free-lora", plain, [(0, 1.0)])])
    assert _ids(out["free-base"]) == _ids(alone["free-base"]) and len(_ids(alone["free-base"])) == 6
    assert _ids(out["free-lora"]) == _ids(alone["free-lora"])


@pytest.mark.slow
def test_max_tokens_cuts_a_constrained_row_with_length(engine):
    fmt = ResponseFormat(
        "json_schema", schema=json.dumps({"type": "object", "properties": {"s": {"type": "string", "minLength": 50}}})
    )
    out = _run_batch(engine, [("short", SamplingParams(max_tokens=5, response_format=fmt), [])])
    fin = out["short"][-1]
    assert isinstance(fin, FinishedEvent) and fin.finish_reason == "length" and len(_ids(out["short"])) == 5
    assert fin.text.startswith("{")


@pytest.mark.slow
def test_a_format_the_engine_cannot_follow_ends_with_an_error_not_a_stop(engine):
    # 2 001 alternatives in a rule: valid, but the engine's parser holds at most 2 000 items a
    # row, so its matcher refuses the first token. That ended the request "stop" with an
    # unfinished text, as if the format were complete.
    wide = ResponseFormat("grammar", grammar="start: x\nx: " + " | ".join(f'"v{i}"' for i in range(2001)))
    out = _run_batch(
        engine,
        [
            ("wide", SamplingParams(max_tokens=8, response_format=wide), []),
            ("plain", SamplingParams(max_tokens=3, ignore_eos=True), []),
        ],
    )
    end = out["wide"][-1]
    assert isinstance(end, ErrorEvent) and isinstance(end.error, InvalidRequestError), end
    assert str(end.error) == (
        "response_format: the grammar engine could not follow this grammar format at generated token 1 "
        "(Parser Error: Current row has 2002 items; max is 2000; consider making your grammar left-recursive "
        "if it's right-recursive); simplify the format"
    )
    assert len(_ids(out["wide"])) == 1  # the token the mask allowed is still delivered
    assert len(_ids(out["plain"])) == 3 and isinstance(out["plain"][-1], FinishedEvent)  # the batch goes on


def test_a_format_that_fails_in_a_mask_is_refused_every_time_after(engine):
    """A regex whose lexer passes the engine's limit lazily, while a mask is computed: the engine
    shares that state between the format's copies, so the next request's matcher started failed
    and its first mask allowed only end-of-sequence — an empty answer that finished "stop". Now
    the first request ends with an error and the format is refused at submit afterwards."""
    fmt = ResponseFormat("regex", pattern="c(a{1000}){1000}")
    first = _run_batch(engine, [("r0", SamplingParams(max_tokens=4, response_format=fmt), [])])["r0"]
    assert isinstance(first[-1], ErrorEvent) and "too many expressions" in str(first[-1].error), first
    for attempt in range(2):
        with pytest.raises(InvalidRequestError, match="regex: lexer error: too many expressions constructed"):
            _run_batch(engine, [(f"again{attempt}", SamplingParams(max_tokens=4, response_format=fmt), [])])
    plain = _run_batch(engine, [("plain", SamplingParams(max_tokens=3, ignore_eos=True), [])])["plain"]
    assert len(_ids(plain)) == 3 and isinstance(plain[-1], FinishedEvent)  # the worker keeps serving


@pytest.mark.slow
def test_bad_schema_is_a_request_error_and_the_worker_keeps_serving(engine):
    with pytest.raises(InvalidRequestError, match="response_format: json_schema: Invalid type: foo"):
        engine.submit(
            request_id="bad",
            prompt_tokens=[1, 450],
            prompt_text=None,
            params=SamplingParams(response_format=ResponseFormat("json_schema", schema='{"type": "foo"}')),
            adapters=NO_ADAPTERS,
            emit=lambda ev: None,
        )
    out = _run_batch(engine, [("after", SamplingParams(max_tokens=3, ignore_eos=True), [])])
    assert len(_ids(out["after"])) == 3


# ---------------------------------------------------------------------------- HTTP parsing

INLINE = InlineChecker()  # compiles in the test process (the server's checker is a process pool)


def _chat(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})


def test_http_response_format_and_vllm_extensions():
    assert response_format_of(_chat(), INLINE) is None
    assert response_format_of(_chat(response_format={"type": "text"}), INLINE) is None
    rf = response_format_of(_chat(response_format={"type": "json_object"}), INLINE)
    assert rf is not None and rf.type == common_pb2.ResponseFormat.TYPE_JSON_OBJECT
    rf = response_format_of(
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}),
        INLINE,
    )
    assert rf is not None and rf.type == common_pb2.ResponseFormat.TYPE_JSON_SCHEMA and rf.strict
    assert json.loads(rf.schema) == SCHEMA
    comp = CompletionRequest.model_validate({"model": "m", "prompt": "x", "guided_regex": "[0-9]+"})
    rf = response_format_of(comp, INLINE)
    assert rf is not None and rf.type == common_pb2.ResponseFormat.TYPE_REGEX and rf.regex == "[0-9]+"
    rf = response_format_of(_chat(guided_json=json.dumps(SCHEMA)), INLINE)
    assert rf is not None and json.loads(rf.schema) == SCHEMA
    rf = response_format_of(_chat(guided_choice=["yes", "no"]), INLINE)
    assert rf is not None and rf.type == common_pb2.ResponseFormat.TYPE_GRAMMAR
    rf = response_format_of(_chat(structured_outputs={"grammar": 'start: "a"'}), INLINE)
    assert rf is not None and rf.grammar == 'start: "a"'
    hints = {"regex": "[0-9]+", "disable_any_whitespace": True, "disable_fallback": True, "whitespace_pattern": None}
    rf = response_format_of(_chat(structured_outputs=hints), INLINE)  # hints that change nothing here
    assert rf is not None and rf.regex == "[0-9]+"


@pytest.mark.parametrize(
    ("extra", "param", "text"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
            "response_format.json_schema.schema",
            "Invalid type: foo",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'xml' is not supported"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
        ({"guided_regex": "(a"}, "guided_regex", "unclosed group"),
        ({"guided_grammar": "start: nope"}, "guided_grammar", "unknown name"),
        ({"guided_json": "{"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one structured-output"),
        # JSON text the decoder cannot take (these were 500s): nested past the recursion limit,
        # an integer past Python's 4 300-digit limit
        ({"guided_json": "[" * 5000 + "]" * 5000}, "guided_json", "not valid JSON: nested too deeply"),
        (
            {"structured_outputs": {"json": '{"a":' * 5000 + "1" + "}" * 5000}},
            "structured_outputs.json",
            "not valid JSON: nested too deeply",
        ),
        ({"guided_json": '{"maximum": ' + "9" * 5000 + "}"}, "guided_json", "not valid JSON: Exceeds the limit"),
        # vLLM keys this server does not implement were ignored: the output went unconstrained
        (
            {"structured_outputs": {"structural_tag": '{"type": "structural_tag"}'}},
            "structured_outputs.structural_tag",
            "'structured_outputs.structural_tag' is not supported: this server implements json, regex, grammar",
        ),
        (
            {"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " *"}},
            "structured_outputs.whitespace_pattern",
            "is not supported",
        ),
        ({"structured_outputs": {"ebnf": "root ::= 'a'"}}, "structured_outputs.ebnf", "is not supported"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": '{"maximum": ' + "9" * 5000 + "}"}}},
            "response_format.json_schema.schema",
            "not valid JSON: Exceeds the limit",
        ),
    ],
)
def test_http_bad_formats_are_400_naming_the_field(extra, param, text):
    with pytest.raises(OpenAIError) as exc:
        response_format_of(_chat(**extra), INLINE)
    assert exc.value.status == 400 and exc.value.param == param and text in str(exc.value)
