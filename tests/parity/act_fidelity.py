"""The parity statistics of each activation-precision setting, side by side in one process.

``python -m tests.parity.act_fidelity [--models gemma,qwen] [--settings all-i16,policy,all-i8]``

For each model (Gemma 3 270M against ``tests/fixtures/golden.json``, Qwen2.5-Coder-0.5B
against ``tests/fixtures/qwen/golden.json``; packed weights, f32 compute) and each setting —
``all-i16`` (``LORAPLANE_KERNEL_ACT=i16``), ``policy`` (unset: each weight's own
``QuantLinear.act`` and the head's ``rescore`` from ``worker.runtime.model.assign_acts``),
``all-i8`` (``LORAPLANE_KERNEL_ACT=i8``), ``rescore`` (the policy with the LM head's top
``--rescore`` candidates per row recomputed with int16 activations; 0: none) — prints every golden group's worst case
mean |Δ log-prob|, 95th percentile and argmax agreement, computed teacher-forced exactly as
``tests/parity/test_model_parity.py`` / ``test_qwen_parity.py`` do (bounds: case mean ≤ 0.10,
p95 ≤ 0.25, argmax ≥ 95 %; tests/fixtures/README.md). The model is loaded once per model and
the environment variable toggled between settings (it is read at every matmul).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

from tests.helpers.parity_compare import GroupStats, compare_case, teacher_forced_logprobs
from worker.lora.adapter import load_lora_adapter
from worker.lora.adapter_set import AdapterSet
from worker.runtime.context import Model
from worker.runtime.kernels import QuantLinear
from worker.runtime.model import LM_HEAD_NAMES, default_model_path, load_model

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SETTINGS = {"all-i16": "i16", "policy": None, "all-i8": "i8", "rescore": None}
"""label -> ``LORAPLANE_KERNEL_ACT`` (None: unset). ``rescore``: the policy with the LM head's
``QuantLinear.rescore`` set to ``--rescore`` (top candidates recomputed with i16; 0: none)."""
BOUNDS = (0.10, 0.25, 0.95)  # case mean, group p95, argmax rate


def _model(name: str) -> tuple[Model, dict, dict]:
    """(model with the golden adapters, golden.json, adapter id -> name)."""
    if name == "gemma":
        path, gold, arch = default_model_path(), FIXTURES / "golden.json", "gemma3"
        adir = FIXTURES / "adapters"
        ids = {0: "shout", 1: "sea", 2: "shout_embd", 3: "critic_alora"}
    elif name == "qwen":
        from tests.helpers.registry_models import assemble

        path, gold, arch = Path(assemble("qwen2.5-coder-0.5b")), FIXTURES / "qwen" / "golden.json", "qwen2"
        adir = FIXTURES / "qwen" / "adapters"
        ids = {0: "shout", 1: "arr"}
    else:
        raise SystemExit(f"unknown model {name}")
    model = Model(load_model(path, dtype="f32", device="cpu", weights="packed"))
    for aid, an in ids.items():
        model.adapters.add(
            aid, load_lora_adapter(adir / f"{an}.gguf", base_arch=arch, base_tensors=model.base.tensor_ne)
        )
    return model, json.loads(gold.read_text()), ids


def groups_for(model: Model, ctx, golden: dict) -> dict[str, GroupStats]:
    """Every golden completion teacher-forced, grouped by its ``case`` string."""
    groups: dict[str, GroupStats] = defaultdict(GroupStats)
    for case in golden["completions"]:
        s = AdapterSet.of({e["id"]: (model.adapters.by_id[e["id"]], e["scale"]) for e in case["lora"]})
        lp = teacher_forced_logprobs(ctx, case["prompt_tokens"], case["tokens"], s)
        groups[case["case"]].cases.append(compare_case(case["prompt"][-40:], lp, case["steps"]))
    return groups


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.parity.act_fidelity", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gemma,qwen")
    ap.add_argument("--settings", default="all-i16,policy,all-i8")
    ap.add_argument("--rescore", type=int, default=64, help="candidates per row of the 'rescore' setting")
    args = ap.parse_args(argv)
    settings = args.settings.split(",")
    ok = True
    for mname in args.models.split(","):
        model, golden, _ = _model(mname)
        packed = {n: w for n, w in model.base.weights.items() if isinstance(w, QuantLinear)}
        by_act: dict[str, set[str]] = {}
        for n, w in packed.items():
            a = w.resolved_act()
            if a != "i16":
                by_act.setdefault(a, set()).add(n)
        kinds = {a: sorted({n.split(".")[-2] if n.startswith("blk.") else n for n in ns}) for a, ns in by_act.items()}
        desc = "; ".join(f"{a}: {len(by_act[a])} weights ({', '.join(ks)})" for a, ks in sorted(kinds.items()))
        print(f"== {mname} ({model.base.arch}); activations other than int16 under the policy: {desc or 'none'}")
        ctx = model.new_context(n_ctx_seq=512, n_seq=4)
        res = {}
        head = next((w for n, w in packed.items() if n in LM_HEAD_NAMES and w.act == "i8"), None)
        assigned = head.rescore if head is not None else 0  # the policy's own re-score
        for st in settings:
            if head is not None:
                head.rescore = args.rescore if st == "rescore" else assigned
            old = os.environ.pop("LORAPLANE_KERNEL_ACT", None)
            forced = SETTINGS[st]
            if forced is not None:
                os.environ["LORAPLANE_KERNEL_ACT"] = forced
            try:
                res[st] = groups_for(model, ctx, golden)
            finally:
                os.environ.pop("LORAPLANE_KERNEL_ACT", None)
                if old is not None:
                    os.environ["LORAPLANE_KERNEL_ACT"] = old
        print(f"{'group':32s} " + " ".join(f"{st + ' mean/p95/argmax':>28s}" for st in settings))
        for g in res[settings[0]]:
            cells = []
            for st in settings:
                gs = res[st][g]
                within = gs.worst_mean <= BOUNDS[0] and gs.p95 <= BOUNDS[1] and gs.argmax_rate >= BOUNDS[2]
                ok &= within or st != "policy"
                cells.append(f"{gs.worst_mean:.4f}/{gs.p95:.4f}/{gs.argmax_rate * 100:5.1f}%{'' if within else ' OUT'}")
            print(f"{g:32s} " + " ".join(f"{c:>28s}" for c in cells))
        ctx.close()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
