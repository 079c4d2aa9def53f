"""loraplane.formats.tokenizer on llama.cpp's own tokenizer test vocabularies (``ggml-vocab-*.gguf``
with their ``.inp`` / ``.out`` cases, shipped in the llama-cpp-python 0.3.36 sdist), plus the
BPE-specific rules: special tokens, BOS, end-of-generation ids, load errors, load time and
byte-level detokenization.

The cases are run as llama.cpp's ``tests/test-tokenizer-0.cpp`` runs them: inputs separated by
``"\\n__ggml_vocab_test__\\n"``, one line of ids per input in ``.out`` (stripped), and
``common_tokenize(text, add_special=false, parse_special=false)``.
"""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import pytest

from loraplane.formats.gguf.reader import read_gguf
from loraplane.formats.tokenizer import Tokenizer, TokenizerError
from loraplane.formats.tokenizer.bpe import BYTE_TO_CHAR
from worker.serving.output import IncrementalDetokenizer

# Every vocab file of the sdist whose type and pre-tokenizer we build, with its case count.
CHECKED = {
    "qwen2": 46,
    "qwen35": 50,
    "llama-bpe": 46,
    "gpt-2": 46,
    "mpt": 46,
    "starcoder": 46,
    "refact": 46,
    "command-r": 46,
    "falcon": 46,
    "deepseek-llm": 46,
    "deepseek-coder": 46,
    "phi-3": 46,  # SPM
    "llama-spm": 46,  # SPM
}
_SEP = "\n__ggml_vocab_test__\n"


def read_cases(vocab: Path) -> list[tuple[str, list[int]]]:
    """``read_tests`` of test-tokenizer-0.cpp: (input text, llama.cpp's ids) pairs."""
    raw = Path(f"{vocab}.inp").read_bytes().decode("utf-8")
    inputs: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(_SEP, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(_SEP)
    lines = Path(f"{vocab}.out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # std::getline yields no line after the final newline
    assert len(lines) == len(inputs), f"{vocab.name}: {len(inputs)} inputs, {len(lines)} outputs"
    return [(text, [int(t) for t in line.strip().split()]) for text, line in zip(inputs, lines, strict=True)]


_LOADED: dict[str, Tokenizer] = {}


@pytest.fixture(scope="module")
def load(llama_cpp_vocab_dir: Path):
    """``load(name) -> Tokenizer`` of ``ggml-vocab-<name>.gguf``, built once per module."""

    def get(name: str) -> Tokenizer:
        if name not in _LOADED:
            _LOADED[name] = Tokenizer.from_gguf(read_gguf(llama_cpp_vocab_dir / f"ggml-vocab-{name}.gguf"))
        return _LOADED[name]

    yield get
    _LOADED.clear()


# ------------------------------------------------------------------------- llama.cpp's own cases


@pytest.mark.slow  # every vocabulary's whole case file (6 s on a 2-core AMD EPYC); qwen2's checks below stay fast
@pytest.mark.parametrize("name", sorted(CHECKED))
def test_every_llama_cpp_case_matches(name: str, load, llama_cpp_vocab_dir: Path) -> None:
    tok = load(name)
    cases = read_cases(llama_cpp_vocab_dir / f"ggml-vocab-{name}.gguf")
    assert len(cases) == CHECKED[name]
    wrong = [(text, got, want) for text, want in cases if (got := tok.encode(text, False, False)) != want]
    assert not wrong, wrong[:3]
    if tok.vocab_type == "gpt2":  # byte-level BPE is lossless: the ids spell the input back
        lost = [text for text, want in cases if tok.decode(want, skip_special=False) != text]
        assert not lost, lost[:3]


def test_no_supported_vocab_file_is_left_unchecked(llama_cpp_vocab_dir: Path) -> None:
    """Every vocab file with cases is either in CHECKED or refused at load (no silent omission)."""
    names = sorted(
        p.name.removeprefix("ggml-vocab-").removesuffix(".gguf")
        for p in llama_cpp_vocab_dir.glob("ggml-vocab-*.gguf")
        if Path(f"{p}.inp").exists()
    )
    assert set(CHECKED) <= set(names)
    for name in set(names) - set(CHECKED):  # bert-bge (WPM), gemma-4 (its own BPE model type)
        with pytest.raises(TokenizerError, match="not supported"):
            Tokenizer.from_gguf(read_gguf(llama_cpp_vocab_dir / f"ggml-vocab-{name}.gguf"))


# ------------------------------------------------------------------------------- BPE load rules


def test_qwen2_vocab_builds_in_under_two_seconds(llama_cpp_vocab_dir: Path) -> None:
    """151 936 tokens, 151 387 merges; nothing is cached on disk (budget 2 s, asserted at 5 s)."""
    gg = read_gguf(llama_cpp_vocab_dir / "ggml-vocab-qwen2.gguf")
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(gg)
    elapsed = time.perf_counter() - t0
    print(f"\nqwen2 tokenizer ({tok.n_vocab} tokens) built in {elapsed:.3f} s")
    assert tok.n_vocab == 151936
    assert elapsed < 5.0, f"building the qwen2 tokenizer took {elapsed:.2f} s"
    _LOADED.setdefault("qwen2", tok)  # the tests below use it: built once (1.5 s of a core)


def test_qwen2_special_tokens_bos_and_eog(load) -> None:
    q = load("qwen2")
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = q.encode(text, parse_special=True)
    assert ids == [151644, 872, 198, 6023, 151645]
    assert [q.token_to_piece(i) for i in ids] == ["<|im_start|>", "user", "\n", "hi", "<|im_end|>"]
    plain = q.encode(text, parse_special=False)
    assert 151644 not in plain and 151645 not in plain
    assert plain[:6] == [27, 91, 318, 4906, 91, 29]  # "<", "|", "im", "_start", "|", ">"
    assert q.decode(plain) == text and q.decode(ids) == "user\nhi"
    assert q.decode(ids, skip_special=False) == text
    assert q.add_bos is False and q.add_eos is False and q.pre == "qwen2"
    assert q.encode("") == [] and q.encode("", add_special=False) == []
    assert q.bos_id == q.eos_id == 151643
    assert q.eog_ids == {151643, 151645, 128247}  # <|endoftext|>, <|im_end|>, "</s>" (by text, as llama.cpp)


def test_llama3_adds_begin_of_text_and_ignores_merges(load) -> None:
    t = load("llama-bpe")
    assert t.add_bos is True and t.bos_id == 128000
    assert t.encode("") == [128000] and t.encode("", add_special=False) == []
    assert t.encode("Hello world") == [128000, 9906, 1917]
    assert t.decode([128000, 9906, 1917]) == "Hello world"
    assert t.eog_ids == {128001, 128009}  # <|end_of_text|>, <|eot_id|>


def test_gpt2_defaults(load) -> None:
    g = load("gpt-2")
    assert (g.bos_id, g.eos_id, g.add_bos, g.eog_ids) == (50256, 50256, False, {50256})


# ------------------------------------------------------------------ byte-level detokenization


def test_multibyte_character_split_over_tokens_is_never_broken(load) -> None:
    """The llama emoji spans three Qwen tokens (" \\xf0\\x9f", "\\xa6", "\\x99"); the streaming
    detokenizer holds the partial bytes back and never yields U+FFFD."""
    q = load("qwen2")
    text = "héllo 🦙 wörld 龘"
    ids = q.encode(text)
    assert ids[:9] == [71, 18503, 385, 11162, 99, 247, 289, 9416, 507]
    assert [q.token_bytes(i) for i in ids[3:6]] == [b" \xf0\x9f", b"\xa6", b"\x99"]
    detok = IncrementalDetokenizer(q)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert pieces[3:6] == [" ", "", "🦙"]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == q.decode(ids) == text
    # the same character as four single-byte tokens
    byte_ids = [q._vocab.piece_to_id[BYTE_TO_CHAR[b]] for b in "🦙".encode()]
    detok = IncrementalDetokenizer(q)
    assert [detok.push(i) for i in byte_ids] == ["", "", "", "🦙"]
    assert q.token_to_piece(byte_ids[0]) == "\ufffd"  # a lone lead byte, for display


# ------------------------------------------------------------------ synthetic vocabularies


def _write_bpe_gguf(path: Path, pre: str | None, extra: list[str], types: list[int] | None = None) -> Path:
    """A tiny gpt2 vocab: the 256 byte characters, "ab" with its merge, then ``extra`` tokens."""
    tokens = [BYTE_TO_CHAR[b] for b in range(256)] + ["ab", *extra]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types or [1] * 257 + [3] * len(extra))
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unknown_pre_tokenizer_is_refused_with_the_supported_list(tmp_path: Path) -> None:
    path = _write_bpe_gguf(tmp_path / "v.gguf", "no-such-pre", [])
    with pytest.raises(TokenizerError, match="'no-such-pre' is not supported") as info:
        Tokenizer.from_gguf(read_gguf(path))
    for name in ("qwen2", "llama-bpe", "gpt-2", "default", "tekken", "smollm"):
        assert name in str(info.value)
    assert str(path) in str(info.value)


def test_absent_pre_is_default_and_gpt2_bos_eos_default_to_11(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(read_gguf(_write_bpe_gguf(tmp_path / "v.gguf", None, [])))
    assert tok.pre == "default" and tok.bos_id == tok.eos_id == 11 and tok.add_bos is False
    assert tok.encode("ab ab!") == [256, 32, 256, 33]  # "ab", "Ġ" + "ab" ("Ġab" is no token), "!"


def test_gpt_oss_end_is_no_eog_when_return_and_call_exist(tmp_path: Path) -> None:
    extra = ["<|return|>", "<|call|>", "<|end|>", "<|channel|>"]
    tok = Tokenizer.from_gguf(read_gguf(_write_bpe_gguf(tmp_path / "v.gguf", "gpt-4o", extra)))
    rid, cid, eid, chid = 257, 258, 259, 260
    assert rid in tok.eog_ids and cid in tok.eog_ids and eid not in tok.eog_ids
    # <|end|> and <|channel|> became USER_DEFINED: cut out and rendered even without parse_special
    assert tok.encode("<|end|>x<|channel|>", parse_special=False) == [eid, ord("x"), chid]
    assert tok.decode([eid, chid]) == "<|end|><|channel|>"
    assert tok.decode([rid]) == "" and tok.decode([rid], skip_special=False) == "<|return|>"
