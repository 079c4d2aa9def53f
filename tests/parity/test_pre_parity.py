"""``tokenizer.ggml.pre`` values that no llama.cpp vocab test file carries, against llama.cpp:
each one's tokenizer-only tiny model (``tests.helpers.tiny_models.model_pre``: a real vocabulary with
the pre value under test, or none) is regenerated, checked by sha256 against the file its
golden in ``tests/fixtures/tiny_archs/pre/`` was made from, and our `Tokenizer` built from it
must give llama-server's ``/tokenize`` ids (BOS as llama.cpp decided) for every string of
``pre/cases.json``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from loraplane.formats.gguf.reader import read_gguf
from loraplane.formats.tokenizer import Tokenizer
from tests.helpers.tiny_models import PRE_VOCAB, model_pre

# slow tier: twelve pre-tokenizers, each over llama.cpp's whole test corpus (13 s on a 2-core AMD EPYC)
pytestmark = pytest.mark.slow

# pre value -> (golden file stem, the pre type we resolve it to, adds BOS)
_EXPECT = {
    "tekken": ("tekken", "tekken", True),
    "smollm": ("smollm", "smollm", False),
    "deepseek-r1-qwen": ("deepseek-r1-qwen", "deepseek-r1-qwen", False),
    "default": ("default", "default", False),
    "": ("none", "default", False),
    "llama3": ("llama3", "llama3", True),
    "dbrx": ("dbrx", "dbrx", False),
    "smaug-bpe": ("smaug-bpe", "smaug-bpe", False),
}


def test_every_pre_value_has_a_golden():
    assert set(_EXPECT) == set(PRE_VOCAB)


@pytest.mark.parametrize("pre", list(PRE_VOCAB), ids=lambda p: p or "absent")
def test_pre_tokenizer_matches_llama_cpp(pre: str, tmp_path: Path, fixtures_dir: Path):
    stem, pre_type, add_bos = _EXPECT[pre]
    golden = json.loads((fixtures_dir / "tiny_archs" / "pre" / f"{stem}.json").read_text())
    path = model_pre(tmp_path / f"{stem}.gguf", pre)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == golden["model_sha256"], (
        f"{pre!r}: generator no longer writes the golden's model"
    )
    spec = json.loads((fixtures_dir / "tiny_archs" / "pre" / "cases.json").read_text())
    assert [c["text"] for c in golden["tokenize"]] == spec["tokenize"], f"{pre!r}: golden made from other strings"
    tok = Tokenizer.from_gguf(read_gguf(path))
    assert (tok.vocab_type, tok.pre, tok.add_bos) == ("gpt2", pre_type, add_bos)
    bad = [c["text"] for c in golden["tokenize"] if tok.encode(c["text"]) != c["tokens"]]
    assert not bad, f"{pre!r}: {len(bad)}/{len(golden['tokenize'])} strings differ from llama.cpp: {bad!r}"
