"""Run sizes: ``full`` (the default), ``--quick`` and ``--smoke``.

All three print the same table shape; they differ in repetitions, request counts, output
lengths and the set of K (number of adapters) the serving scenario sweeps. The full run is
sized for a 2-core CPU machine where one decode step of the 270M model takes 0.1–0.3 s, so
compatibility batching with 16 adapters (one adapter set per step) is the long pole.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class Profile:
    """Every size the benchmarks use (printed and written to the JSON as ``params``).

    Attributes:
        reps: repetitions of every figure (median shown with min and max).
        pp_tokens: prompt length of the prompt-processing figure (one ubatch).
        decode_batches / decode_steps / decode_ctx: decode figure: sequences per step, steps
            timed per repetition, context each sequence already holds.
        streams / slots / requests / max_tokens / prompt_tokens / ks: multi-tenant serving:
            concurrent closed-loop client streams, worker slots, requests per run, output
            tokens per request (``ignore_eos``), prompt length, adapter counts swept.
        single_requests: requests of the 1-stream row (K=0, one closed-loop stream, same
            output length; 0 = no such row).
        prefix_*: prefix reuse: shared system prompt length, requests per run, adapters they
            alternate among, worker slots, user tokens after the system prompt, output tokens.
        lifecycle_adapters / lifecycle_samples: adapters registered for the memory figures,
            and how many of them are timed register→first token (and cold-loaded directly).
        bw_mib: tensor size of the memory-bandwidth copy.
        paging_*: adapter paging (scenario 6): adapters registered (F16, ranks 8/16 on the
            attention weights), how many fit in the comparison run, worker ``--max-loras`` /
            ``--max-cpu-loras``, requests after ``paging_warmup`` warm-up requests, output
            tokens, streams.
        longprompt_*: long prompts (scenario 7): distinct prompts of ``longprompt_tokens``
            tokens (no prefix shared between requests), ``longprompt_max_tokens`` output
            tokens, ``longprompt_streams`` closed-loop streams (= slots), ``longprompt_requests``
            requests per run, adapter counts ``longprompt_ks`` (K > 0: Zipf(1.0) popularity).
        longctx_*: long-context decode (scenario 8): one closed-loop stream,
            ``longctx_requests`` requests per context length and repetition, prompts of
            ``longctx_tokens`` and of ``longctx_short`` tokens, ``longctx_max_tokens`` output
            tokens each; ITL measured between the output tokens (after the prompt).
        bounds_batch / bounds_run_s: compute bounds (scenario 9): the decode batch whose
            step is bounded, and the seconds each peak-rate measurement runs for.
    """

    name: str
    reps: int = 3
    pp_tokens: int = 512
    decode_batches: tuple[int, ...] = (1, 8, 16, 32)
    decode_steps: int = 8
    decode_ctx: int = 32
    streams: int = 16
    slots: int = 16
    requests: int = 32
    max_tokens: int = 64
    prompt_tokens: int = 16
    ks: tuple[int, ...] = (0, 1, 4, 16)
    single_requests: int = 8
    prefix_len: int = 256
    prefix_requests: int = 8
    prefix_adapters: int = 4
    prefix_slots: int = 2
    prefix_user_tokens: int = 16
    prefix_max_tokens: int = 4
    lifecycle_adapters: int = 64
    lifecycle_samples: int = 3
    bw_mib: int = 256
    paging_adapters: int = 1000
    paging_fit: int = 16
    paging_max_loras: int = 32
    paging_max_cpu_loras: int = 128
    paging_requests: int = 256
    paging_warmup: int = 16
    paging_max_tokens: int = 32
    paging_streams: int = 16
    longprompt_tokens: int = 1500
    longprompt_max_tokens: int = 64
    longprompt_streams: int = 8
    longprompt_requests: int = 16
    longprompt_ks: tuple[int, ...] = (0, 16)
    longctx_tokens: int = 3000
    longctx_short: int = 100
    longctx_max_tokens: int = 32
    longctx_requests: int = 2
    bounds_batch: int = 16
    bounds_run_s: float = 0.25

    def to_json(self) -> dict:
        return asdict(self)


FULL = Profile("full", reps=3, requests=32, max_tokens=32)
QUICK = Profile(
    "quick",
    reps=1,
    decode_steps=4,
    requests=16,
    max_tokens=12,
    ks=(0, 4),
    single_requests=4,
    prefix_requests=8,
    lifecycle_adapters=16,
    lifecycle_samples=2,
    bw_mib=128,
    paging_adapters=100,
    paging_fit=8,
    paging_max_loras=8,
    paging_max_cpu_loras=24,
    paging_requests=48,
    paging_warmup=8,
    paging_max_tokens=8,
    paging_streams=8,
    longprompt_tokens=512,
    longprompt_max_tokens=16,
    longprompt_requests=8,
    longctx_tokens=1000,
    longctx_max_tokens=16,
    longctx_requests=1,
)
SMOKE = Profile(
    "smoke",
    reps=1,
    pp_tokens=64,
    decode_steps=2,
    decode_ctx=8,
    streams=4,
    slots=4,
    requests=4,
    max_tokens=4,
    prompt_tokens=8,
    ks=(0, 4),
    prefix_len=32,
    single_requests=2,
    prefix_requests=6,
    prefix_user_tokens=4,
    prefix_max_tokens=2,
    lifecycle_adapters=4,
    lifecycle_samples=1,
    bw_mib=32,
    paging_adapters=6,
    paging_fit=2,
    paging_max_loras=2,
    paging_max_cpu_loras=3,
    paging_requests=6,
    paging_warmup=2,
    paging_max_tokens=2,
    paging_streams=2,
    longprompt_tokens=96,
    longprompt_max_tokens=4,
    longprompt_streams=2,
    longprompt_requests=4,
    longprompt_ks=(0, 4),
    longctx_tokens=160,
    longctx_short=16,
    longctx_max_tokens=4,
    longctx_requests=1,
    bounds_run_s=0.05,
)

PROFILES = {p.name: p for p in (FULL, QUICK, SMOKE)}


def with_overrides(profile: Profile, **overrides) -> Profile:
    """``profile`` with the non-None ``overrides`` applied."""
    return replace(profile, **{k: v for k, v in overrides.items() if v is not None})
