"""Make llama.cpp parity goldens for a model: ``llama-server``'s tokenization of a string set and its
greedy continuations with top-k log-probs, base and with adapters (the format of
``tests/fixtures/golden.json``, read by ``tests/helpers/parity_compare.py``).

    python -m bench.parity_goldens --llama-server PATH --model M.gguf [--lora A.gguf ...] \\
        --cases CASES.json --out GOLDEN.json

``CASES.json``: ``{"tokenize": [text, ...], "prompts": [text, ...], "n_predict": 24,
"cases": [{"case": "base", "lora": {}}, {"case": "shout@1", "lora": {"0": 1.0}}, ...]}`` —
every case runs on every prompt; ``lora`` maps an index into ``--lora`` to its scale (the
others are sent as 0: llama-server reads an absent list as "the global scales"). A prompt given
as a list of ints is sent as token ids. The golden records the sha256 of the model and of
each adapter. Each request: ``temperature 0, top_k 1, n_probs 5, post_sampling_probs false,
cache_prompt false`` (log-probs before sampling).

Build llama-server for this CPU with ``bench/build_llama_server.sh``; commit the goldens,
never the build.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.servers import LlamaServer

N_PROBS = 5


def _post(server: LlamaServer, path: str, body: dict[str, Any]) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"llama-server {path} answered {resp.status}: {data[:500]!r}")
        return json.loads(data)
    finally:
        conn.close()


def tokenize(server: LlamaServer, text: str) -> list[int]:
    """``/tokenize`` with ``add_special`` and ``parse_special`` on (what a prompt gets)."""
    return list(_post(server, "/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"])


def complete(server: LlamaServer, prompt: str | list[int], scales: dict[int, float], n_predict: int) -> dict[str, Any]:
    """One greedy completion: ``prompt_tokens``, ``content``, ``tokens`` (every generated id) and
    per generated position ``steps`` = ``{id, logprob, top: [{id, logprob}] × 5}`` (before
    sampling), cut before the first token llama-server reports none for (``aligned_steps``)."""
    prompt_tokens = prompt if isinstance(prompt, list) else tokenize(server, prompt)
    out = _post(
        server,
        "/completion",
        {
            "prompt": prompt_tokens,
            "n_predict": n_predict,
            "temperature": 0.0,
            "top_k": 1,
            "n_probs": N_PROBS,
            "post_sampling_probs": False,
            "cache_prompt": False,
            "return_tokens": True,
            "lora": server.lora_vector(scales),
        },
    )
    steps = [
        {
            "id": p["id"],
            "logprob": p["logprob"],
            "top": [{"id": t["id"], "logprob": t["logprob"]} for t in p["top_logprobs"]],
        }
        for p in out.get("completion_probabilities", [])
    ]
    tokens = [int(t) for t in out.get("tokens", [s["id"] for s in steps])]
    return {
        "prompt_tokens": prompt_tokens,
        "content": out["content"],
        "tokens": tokens,
        "steps": aligned_steps(tokens, steps),
    }


def aligned_steps(tokens: list[int], steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps of ``tokens``' longest prefix that has them: llama-server gives no log-probs for
    a token that leaves the text with an incomplete UTF-8 character (a byte token), so its list
    skips those positions; the steps are cut before the first skipped one so ``steps[j]`` is
    always the step of ``tokens[j]``."""
    out = []
    for tok, st in zip(tokens, steps, strict=False):
        if st["id"] != tok:
            break
        out.append(st)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_goldens(
    llama_server: str, model: Path, loras: Sequence[Path], spec: dict[str, Any], *, threads: int | None = None
) -> dict[str, Any]:
    """Run every ``spec`` case on every prompt through one llama-server; returns the golden dict."""
    with tempfile.TemporaryDirectory() as run_dir:
        server = LlamaServer(
            llama_server,
            Path(run_dir),
            "golden",
            model=str(model),
            adapters=loras,
            parallel=1,
            n_ctx=4096,
            threads=threads,
        )
        server.start()
        try:
            toks = [{"text": t, "tokens": tokenize(server, t)} for t in spec.get("tokenize", [])]
            comps = []
            for case in spec.get("cases", [{"case": "base", "lora": {}}]):
                scales = {int(k): float(v) for k, v in case.get("lora", {}).items()}
                for prompt in spec.get("prompts", []):
                    res = complete(server, prompt, scales, int(spec.get("n_predict", 24)))
                    lora = [{"id": i, "scale": s} for i, s in sorted(scales.items()) if s != 0.0]
                    comps.append({"case": case["case"], "lora": lora, "prompt": prompt, **res})
        finally:
            server.stop()
    return {
        "model": model.name,
        "model_sha256": _sha256(model),
        "adapters": [p.name for p in loras],
        "adapters_sha256": [_sha256(p) for p in loras],
        "tokenize": toks,
        "completions": comps,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", required=True, help="llama-server binary (bench/build_llama_server.sh)")
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--lora", action="append", default=[], type=Path, help="adapter GGUF; index = order given")
    ap.add_argument("--cases", required=True, type=Path, help="cases JSON (see module docstring)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    golden = make_goldens(
        args.llama_server, args.model, args.lora, json.loads(args.cases.read_text()), threads=args.threads
    )
    args.out.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")
    print(f"{args.out}: {len(golden['tokenize'])} tokenizations, {len(golden['completions'])} completions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
