"""Every architecture against llama.cpp on its tiny random-weight model (``tests/helpers/tiny_models.py``,
regenerated here and checked byte for byte by sha256 against what the goldens in
``tests/fixtures/tiny_archs/`` were made from), in both weight forms, base and with the arch's
rank-4 adapter at scales 1 and 0.5, teacher-forced; and each model's tokenizer (its family's
real llama.cpp vocabulary, ``tests.helpers.tiny_models.VOCAB``) against llama-server's ``/tokenize`` of
the string set in ``tests/fixtures/tiny_archs/cases.json`` and of the completion prompts.

Bounds (fixtures README, "tiny_archs"): per case max |Δ log-prob| ≤ 0.05 and mean ≤ 0.01,
argmax equal wherever llama.cpp's top-1/top-2 margin > 0.1 nats. Statistics are printed
(``pytest -s``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from loraplane.formats.gguf.reader import read_gguf
from loraplane.formats.tokenizer import Tokenizer
from tests.helpers.parity_compare import compare_case, teacher_forced_logprobs
from tests.helpers.tiny_models import ARCHS, MODELS, VOCAB, adapter
from worker.lora.adapter import load_lora_adapter
from worker.lora.adapter_set import AdapterSet
from worker.runtime import arch as arch_registry
from worker.runtime.context import Model, UBatch
from worker.runtime.errors import ModelError
from worker.runtime.model import load_model

pytestmark = pytest.mark.slow

MAX_D, MEAN_D, MARGIN = 0.05, 0.01, 0.1


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-archs")


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tiny_dir: Path, fixtures_dir: Path):
    """``(arch, golden, model path, adapter path)``: the arch's tiny model and adapter written
    by the generator, identical (sha256) to the files its golden was made from."""
    arch = request.param
    golden = json.loads((fixtures_dir / "tiny_archs" / f"{arch}.json").read_text())
    model_path = MODELS[arch](tiny_dir / f"{arch}.gguf")
    lora_path = adapter(arch, tiny_dir / f"{arch}-lora.gguf")
    assert _sha256(model_path) == golden["model_sha256"], f"{arch}: generator no longer writes the golden's model"
    assert [_sha256(lora_path)] == golden["adapters_sha256"], f"{arch}: generator no longer writes the golden's adapter"
    return arch, golden, model_path, lora_path


# Family vocabulary → (tokenizer.ggml.model, pre-tokenizer, adds BOS).
_VOCAB_KIND = {
    "llama-bpe": ("gpt2", "llama-bpe", True),
    "qwen2": ("gpt2", "qwen2", False),
    "phi-3": ("llama", None, True),
    "llama-spm": ("llama", None, True),
}


def test_tokenizer_matches_llama_cpp(tiny, fixtures_dir: Path):
    """Our `Tokenizer` built from the generated GGUF gives llama-server's ``/tokenize`` ids for
    every string of cases.json and for every completion prompt (BOS as the vocab says)."""
    arch, golden, model_path, _ = tiny
    tok = Tokenizer.from_gguf(read_gguf(model_path))
    assert (tok.vocab_type, tok.pre, tok.add_bos) == _VOCAB_KIND[VOCAB[arch]]
    spec = json.loads((fixtures_dir / "tiny_archs" / "cases.json").read_text())
    assert [c["text"] for c in golden["tokenize"]] == spec["tokenize"], f"{arch}: golden made from other strings"
    assert len(golden["tokenize"]) >= 20
    for case in golden["tokenize"]:
        assert tok.encode(case["text"]) == case["tokens"], f"{arch}: {case['text']!r}"
    for case in golden["completions"]:
        assert isinstance(case["prompt"], str), f"{arch}: prompts are text, so they go through the tokenizer"
        assert tok.encode(case["prompt"]) == case["prompt_tokens"], f"{arch}: prompt {case['prompt']!r}"
    print(f"{arch} ({VOCAB[arch]}): {len(golden['tokenize'])} strings and {len(golden['completions'])} prompts")


@pytest.mark.parametrize("weight_form", ["packed", "dequant"])
def test_arch_matches_llama_cpp(tiny, weight_form: str):
    arch, golden, model_path, lora_path = tiny
    model = Model(load_model(model_path, device="cpu", weights=weight_form))
    assert model.base.arch == arch
    model.adapters.add(0, load_lora_adapter(lora_path, base_arch=arch, base_tensors=model.base.tensor_ne))
    ctx = model.new_context(n_ctx_seq=128)
    try:
        worst_max = worst_mean = 0.0
        n_pos = hits = total = 0
        for case in golden["completions"]:
            s = AdapterSet.of({e["id"]: (model.adapters.by_id[e["id"]], e["scale"]) for e in case["lora"]})
            steps = case["steps"]
            lp = teacher_forced_logprobs(ctx, case["prompt_tokens"], case["tokens"][: len(steps)], s)
            st = compare_case(str(case["prompt"]), lp, steps, margin=MARGIN)
            worst_max, worst_mean = max(worst_max, max(st.deltas)), max(worst_mean, st.mean)
            n_pos, hits, total = n_pos + len(st.deltas), hits + st.argmax_hits, total + st.argmax_total
            where = f"{arch} {weight_form} {case['case']} prompt {case['prompt'][:12]!r}…"
            assert max(st.deltas) <= MAX_D, f"{where}: max |d| {max(st.deltas):.4f} > {MAX_D}"
            assert st.mean <= MEAN_D, f"{where}: mean |d| {st.mean:.4f} > {MEAN_D}"
            assert st.argmax_hits == st.argmax_total, f"{where}: argmax {st.argmax_hits}/{st.argmax_total}"
        print(
            f"{arch} {weight_form}: {n_pos} positions, max |d| {worst_max:.4f}, worst case mean {worst_mean:.4f}, "
            f"argmax {hits}/{total}"
        )
    finally:
        ctx.close()


def test_adapter_changes_the_output(tiny):
    """The goldens' adapter cases differ from base (the adapter is not a no-op on any arch)."""
    _, golden, _, _ = tiny
    by = {(c["case"], c["prompt"]): c for c in golden["completions"]}
    diff = [
        abs(by[("lora@1", p)]["steps"][0]["logprob"] - by[("base", p)]["steps"][0]["logprob"])
        + (by[("lora@1", p)]["tokens"] != by[("base", p)]["tokens"])
        for (case, p) in by
        if case == "base"
    ]
    assert max(diff) > 0.1


def test_golden_distributions_are_not_degenerate(tiny):
    """With the 128k/152k vocabularies the random weights still give llama.cpp distributions
    that test something: top-1 log-probs well above uniform (-log n_vocab ≈ -10.4…-11.9) and
    below saturation, and a clear top-1/top-2 margin at most positions."""
    arch, golden, _, _ = tiny
    steps = [st for c in golden["completions"] for st in c["steps"]]
    top1 = [st["top"][0]["logprob"] for st in steps]
    clear = sum(st["top"][0]["logprob"] - st["top"][1]["logprob"] > MARGIN for st in steps)
    assert len(steps) >= 100, f"{arch}: {len(steps)} positions"
    assert -8.0 < min(top1) and max(top1) < -0.05, f"{arch}: top-1 log-probs {min(top1):.2f}…{max(top1):.2f}"
    assert clear >= 0.7 * len(steps), f"{arch}: clear argmax at {clear}/{len(steps)} positions"


def test_unknown_architecture_is_refused():
    with pytest.raises(ModelError) as exc:
        arch_registry.get("mamba9", "/x/m.gguf")
    msg = str(exc.value)
    assert "mamba9" in msg and "/x/m.gguf" in msg
    for name in ("gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen3", "qwen3moe"):
        assert name in msg


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_token_by_token_decode_equals_teacher_forced(arch: str, tiny_dir: Path, fixtures_dir: Path):
    """Decoding one row per step (the batched decode-attention path: soft-capped scores and
    the sliding window for gemma2, LongRoPE factors for phi3) gives the log-probs of the
    one-ubatch teacher-forced pass within 1e-4 (f32 reference weights), two sequences at once."""
    golden = json.loads((fixtures_dir / "tiny_archs" / f"{arch}.json").read_text())
    path = tiny_dir / f"{arch}.gguf"
    if not path.exists():
        MODELS[arch](path)
    model = Model(load_model(path, device="cpu", weights="dequant"))
    ctx = model.new_context(n_ctx_seq=128)
    try:
        cases = [c for c in golden["completions"] if c["case"] == "base"][:2]
        ref = [teacher_forced_logprobs(ctx, c["prompt_tokens"], c["tokens"]) for c in cases]
        toks, pos, seq, want = [], [], [], []
        for s, c in enumerate(cases):
            p = c["prompt_tokens"]
            toks, pos, seq = toks + p, pos + list(range(len(p))), seq + [s + 1] * len(p)
            want += [i == len(p) - 1 for i in range(len(p))]
        got = [[torch.log_softmax(row, -1)] for row in ctx.decode(UBatch(toks, pos, seq, want)).logits]
        for j in range(len(cases[0]["tokens"]) - 1):
            ub = UBatch(
                [c["tokens"][j] for c in cases],
                [len(c["prompt_tokens"]) + j for c in cases],
                [s + 1 for s in range(len(cases))],
                [True] * len(cases),
            )
            for s, row in enumerate(ctx.decode(ub).logits):
                got[s].append(torch.log_softmax(row, -1))
        for s, r in enumerate(ref):
            assert float((torch.stack(got[s]) - r).abs().max()) <= 1e-4, f"{arch} sequence {s}"
    finally:
        for s in range(len(cases)):
            ctx.kv.seq_rm(s + 1)
        ctx.close()
