"""The decode loop's serving tax, before vs after the output thread, side by side in one process.

One in-process ``WorkerEngine`` (``--slots`` sequences, keyed prefix cache) serves ``--streams``
closed-loop client threads; each thread turns every event into its ``GenerateEvent`` proto and
serializes it, as the gRPC stream's writer does (``worker.rpc.servicer.event_to_proto``).
Repetitions alternate two arms on the same engine:

- ``inline``: detokenizing, stop strings and events on the scheduler thread after each step
  (``Scheduler.use_output_thread(False)``: the loop as it was before the output thread);
- ``thread``: the same work on the output thread (``EmitWorker``), the worker's default.

Per repetition it prints the scheduler's step interval p50 (``WorkerStats.step_interval_p50_ms``:
median time between consecutive step starts on the loop, over the last decode-only steps) and
the step on the loop p50, and, measured on the loop thread while it is idle (``run_soon``), the
in-process decode step at B = streams with the scheduler's greedy sampling, and the text work
per step (``EmitWorker.render_s``: detokenizing, stop strings, events; on the loop in the inline
arm, off it in the other). Summary: median [min–max] of each over the repetitions.

Run: ``python -m bench.step_interval [--reps 3] [--streams 16] [--requests 32] [--max-tokens 24]``.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time

import numpy as np
import torch

from bench.engine import random_tokens, token_hi
from loraplane.adapter_scales import NO_ADAPTERS
from loraplane.logging import configure_logging
from worker.config import Batching, PrefixCachePolicy, WorkerConfig
from worker.lora.adapter_set import EMPTY_SET
from worker.rpc.servicer import event_to_proto
from worker.runtime.context_base import UBatch
from worker.runtime.model import default_model_path
from worker.runtime.sampling import Sampler, SamplingParams, greedy_rows, greedy_top
from worker.serving.engine import WorkerEngine
from worker.serving.request import ErrorEvent, FinishedEvent

N_CTX = 20  # context each sequence holds in the in-process step


def in_process_step_ms(engine: WorkerEngine, batch: int, steps: int, seed: int) -> float:
    """Median ms of ``steps`` decode steps of ``batch`` sequences plus the scheduler's greedy
    sampling (``greedy_rows`` + ``Sampler.sample`` per row), run on the scheduler thread between
    requests (``run_soon``: nothing else decodes). Uses KV sequences 0..batch-1 and clears them
    (the keyed prefix-cache policy leaves idle sequences empty)."""

    def run() -> float:
        ctx = engine.ctx
        rng = np.random.default_rng(seed)
        hi = token_hi(engine.base.n_vocab)
        seqs = list(range(batch))
        toks, pos, ids = [], [], []
        for s in seqs:
            toks += random_tokens(rng, N_CTX, hi=hi)
            pos += list(range(N_CTX))
            ids += [s] * N_CTX
        ctx.set_adapters(EMPTY_SET)
        ctx.decode(UBatch(toks, pos, ids, [False] * len(toks)))
        samplers = [Sampler(SamplingParams(max_tokens=steps + 1)) for _ in seqs]
        times = []
        for i in range(steps + 1):  # the first one warms the plan up, excluded
            t0 = time.perf_counter()
            res = ctx.decode(UBatch(random_tokens(rng, batch, hi=hi), [N_CTX + i] * batch, seqs, [True] * batch))
            rows = list(range(len(res.out_rows)))
            logp, top = greedy_rows(res.logits, rows, greedy_top(samplers))
            for j, r in enumerate(rows):
                samplers[j].sample(res.logits[r], logp=logp[j], argmax=top[j])
            if i:
                times.append(time.perf_counter() - t0)
        for s in seqs:
            ctx.kv.seq_rm(s)
        return statistics.median(times) * 1000

    return engine.scheduler.run_soon(run).result(timeout=600)


def serve(engine: WorkerEngine, streams: int, requests: int, max_tokens: int, prompt_tokens: int, seed: int) -> float:
    """``requests`` greedy requests (``ignore_eos``) over ``streams`` closed-loop client threads,
    each serializing every event's proto. Returns the wall time in s."""
    hi = token_hi(engine.base.n_vocab)
    rng = np.random.default_rng(seed)
    prompts = [random_tokens(rng, prompt_tokens, hi=hi) for _ in range(requests)]
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i, p in enumerate(prompts):
        todo.put((f"r{seed}-{i}", p))
    errors: list[str] = []

    def client() -> None:
        while True:
            try:
                rid, prompt = todo.get_nowait()
            except queue.Empty:
                return
            events: queue.SimpleQueue = queue.SimpleQueue()
            engine.submit(
                request_id=rid,
                prompt_tokens=prompt,
                prompt_text=None,
                params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                adapters=NO_ADAPTERS,
                emit=events.put,
            )
            while True:
                ev = events.get(timeout=600)
                if isinstance(ev, ErrorEvent):
                    errors.append(str(ev.error))
                    break
                event_to_proto(rid, ev).SerializeToString()
                if isinstance(ev, FinishedEvent):
                    break

    threads = [threading.Thread(target=client, daemon=True) for _ in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return time.perf_counter() - t0


def _fig(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}–{max(xs):.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--in-process-steps", type=int, default=8)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    configure_logging("info")  # as the worker process does: the loop's debug lines filtered out
    engine = WorkerEngine(
        WorkerConfig(
            model_path=args.model or str(default_model_path()),
            n_seqs=args.streams,
            batching=Batching.MIXED,
            prefix_cache=PrefixCachePolicy.KEYED,
            device="cpu",
            n_ctx_seq=args.prompt_tokens + args.max_tokens + 64,
        )
    )
    print(
        f"torch threads {torch.get_num_threads()}, {args.streams} streams, {args.requests} requests × "
        f"{args.max_tokens} tokens, {args.prompt_tokens}-token prompts"
    )
    res: dict[str, dict[str, list[float]]] = {
        arm: {"interval": [], "busy": [], "in_process": [], "tok_s": [], "render": []} for arm in ("inline", "thread")
    }
    try:
        serve(engine, args.streams, args.streams, 2, args.prompt_tokens, seed=999)  # warm-up
        for rep in range(args.reps):
            for arm in ("inline", "thread"):
                engine.scheduler.use_output_thread(arm == "thread")
                engine.scheduler.steps.step_log.clear()
                wall = serve(engine, args.streams, args.requests, args.max_tokens, args.prompt_tokens, seed=rep)
                st = engine.stats().scheduler
                em = engine.scheduler.emitter
                render_ms = em.render_s / max(1, em.rendered_steps) * 1000  # text work per step, either thread
                ip = in_process_step_ms(engine, args.streams, args.in_process_steps, seed=rep)
                r = res[arm]
                r["interval"].append(st.step_interval_p50_ms)
                r["busy"].append(st.step_busy_p50_ms)
                r["in_process"].append(ip)
                r["tok_s"].append(args.requests * args.max_tokens / wall)
                r["render"].append(render_ms)
                print(
                    f"rep {rep + 1}/{args.reps} {arm:6s}: scheduler step interval p50 {st.step_interval_p50_ms:.1f} ms "
                    f"(step on the loop {st.step_busy_p50_ms:.1f} ms, {st.step_samples} intervals), in-process step "
                    f"incl. sampling B={args.streams} {ip:.1f} ms, interval/in-process "
                    f"{st.step_interval_p50_ms / ip:.3f}, {r['tok_s'][-1]:.1f} tok/s, "
                    f"rendering {render_ms:.2f} ms/step ({'output thread' if arm == 'thread' else 'on the loop'})",
                    flush=True,
                )
    finally:
        engine.close()
    print("\nmedian [min–max] over repetitions")
    for arm, r in res.items():
        ratio = [a / b for a, b in zip(r["interval"], r["in_process"], strict=True)]
        print(
            f"{arm:6s}: scheduler step interval p50 {_fig(r['interval'])} ms | step on the loop {_fig(r['busy'])} ms"
            f" | in-process step incl. sampling {_fig(r['in_process'])} ms | interval/in-process "
            f"{statistics.median(ratio):.3f} [{min(ratio):.3f}–{max(ratio):.3f}] | {_fig(r['tok_s'])} tok/s"
            f" | rendering {_fig(r['render'])} ms/step"
        )


if __name__ == "__main__":
    main()
