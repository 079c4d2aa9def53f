"""Turning the results JSON into tables: ``rich`` on a terminal when installed, plain text
otherwise, and Markdown for ``bench/RESULTS.md`` (``--markdown OUT``).

Every figure is ``median [min–max]`` over the repetitions (just the median for one).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

from bench.stats import Figure, fmt, fmt_fig

GIB = 1 << 30
MIB = 1 << 20


@dataclass
class Section:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _fig(d: dict | None) -> str:
    if not d:
        return "-"
    return fmt_fig(Figure(_f(d.get("median")), _f(d.get("min")), _f(d.get("max")), int(d.get("n", 0))))


def _f(x) -> float:
    return math.nan if x is None else float(x)


def _x(r: float | None) -> str:
    return "-" if r is None or not math.isfinite(r) else f"{r:.2f}×"


def engine_section(e: dict) -> Section:
    s = Section(
        f"1. Engine (in-process decode), dtype {e['dtype']}, {e['device']}, {e['torch_threads']} torch threads",
        ["figure", "base", f"LoRA r{e.get('adapter_rank', 8)} (all linear)", "LoRA overhead (base/LoRA)"],
    )
    b, lo = e["variants"]["base"], e["variants"]["lora"]
    s.rows.append(
        [
            f"prompt processing, {e['pp_tokens']} tokens (tok/s)",
            _fig(b["pp_tok_s"]),
            _fig(lo["pp_tok_s"]),
            _x(e["lora_overhead"]["pp"]),
        ]
    )
    for bs, d in b["decode"].items():
        s.rows.append(
            [
                f"decode B={bs} (tok/s)",
                _fig(d["tok_s"]),
                _fig(lo["decode"][bs]["tok_s"]),
                _x(e["lora_overhead"][f"decode_b{bs}"]),
            ]
        )
        s.rows.append([f"decode B={bs} (ms/step)", _fig(d["step_ms"]), _fig(lo["decode"][bs]["step_ms"]), ""])
        if "step_sampled_ms" in d:
            s.rows.append(
                [
                    f"decode B={bs} incl. sampling (ms/step)",
                    _fig(d["step_sampled_ms"]),
                    _fig(lo["decode"][bs]["step_sampled_ms"]),
                    "",
                ]
            )
    s.notes.append(
        f"decode: {e['decode_steps']} steps per repetition, each sequence holding "
        f"{e['decode_ctx']} tokens of context; adapter A/B = {e['adapter_bytes'] / MIB:.1f} MiB"
    )
    return s


def serving_sections(sv: dict) -> list[Section]:
    peer = sv.get("llama_server")
    s = Section(
        f"2. Multi-tenant serving over gRPC: {sv['streams']} closed-loop streams, {sv['requests']} "
        f"requests × {sv['max_tokens']} output tokens (greedy, ignore_eos), {sv['prompt_tokens']}-token "
        f"prompts, {sv['slots']} slots, prefix cache {sv['prefix_cache']}",
        [
            "workload",
            "server",
            "output tok/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "ITL p50 ms",
            "ITL p99 ms",
            "mean batch",
            "errors",
        ],
    )
    for key in sv["workloads"]:
        arms = [(f"ours, {m}", sv["modes"][m][key]) for m in ("mixed", "compat") if key in sv["modes"][m]]
        if peer:
            arms.append(("llama-server", peer["runs"][key]))
        for label, d in arms:
            s.rows.append(
                [
                    key,
                    label,
                    _fig(d["tok_s"]),
                    _fig(d["ttft_p50_ms"]),
                    _fig(d["ttft_p99_ms"]),
                    _fig(d["itl_p50_ms"]),
                    _fig(d["itl_p99_ms"]),
                    _fig(d.get("mean_batch")),
                    str(d["n_errors"]),
                ]
            )
    s.notes.append(
        f"K = number of rank-{sv.get('adapter_rank', 8)} adapters in the traffic (K=0: base model only); "
        "rr = round-robin, zipf = Zipf(1.0) popularity; mean batch = sequences in the ubatch that produced each token"
    )
    if sv.get("single_key"):
        line = (
            f"{sv['single_key']}: one closed-loop stream, {sv['single_requests']} requests × {sv['max_tokens']} "
            f"tokens, base model (ours: the mixed worker; compat is identical with one sequence)"
        )
        if peer and peer["runs"].get(sv["single_key"], {}).get("per_token_ms"):
            line += (
                f"; llama-server's own timings.predicted_per_token_ms "
                f"{_fig(peer['runs'][sv['single_key']]['per_token_ms'])}"
            )
        s.notes.append(line)
    if sv.get("weights"):
        s.notes.append(f"workers: --weights {sv['weights']}")
    loop = _loop_section(sv)
    cols = ["workload", "mixed/compat tok/s"] + (["ours (mixed)/llama-server tok/s"] if peer else [])
    r = Section("2b. Throughput ratios (medians)", cols)
    for key in sv["workloads"]:
        row = [key, _x(sv["mixed_over_compat"].get(key))]
        if peer:
            row.append(_x(sv["ours_over_llama_server"][key]))
        r.rows.append(row)
    return [s, r] + ([loop] if loop else [])


def _loop_section(sv: dict) -> Section | None:
    """2c: the worker scheduler's step interval vs the in-process step incl. sampling (None
    for results without the loop figures)."""
    mixed = sv["modes"]["mixed"]
    if not any("sched_interval_p50_ms" in d for d in mixed.values()):
        return None
    eng = sv.get("engine_step_sampled_ms")
    sec = Section(
        "2c. Scheduler loop (mixed worker): step interval vs the in-process step",
        ["workload", "scheduler step interval p50 ms", "step on the loop p50 ms", "in-process step incl. sampling ms"],
    )
    for key in sv["workloads"]:
        d = mixed.get(key, {})
        if "sched_interval_p50_ms" not in d:
            continue
        in_proc = _fig(eng) if eng and not key.endswith("1-stream") else ""
        sec.rows.append([key, _fig(d["sched_interval_p50_ms"]), _fig(d["sched_busy_p50_ms"]), in_proc])
    sec.notes.append(
        "interval = median time between consecutive step starts on the worker's scheduler thread over its "
        "last decode-only steps (WorkerStats.step_interval_p50_ms, read after each run); step on the loop = "
        "batch + decode + sampling + hand-off to the output thread; in-process = scenario 1's base decode "
        f"step at B={sv['streams']} with the scheduler's greedy sampling (no gRPC, no scheduler)"
    )
    return sec


def prefix_section(px: dict) -> Section:
    s = Section(
        f"3. Prefix reuse: {px['prefix_len']}-token shared system prompt + {px['user_tokens']} user "
        f"tokens, {px['requests']} requests one at a time alternating among {px['adapters']} adapters, "
        f"{px['slots']} slots, {px['max_tokens']} output tokens",
        [
            "prefix cache",
            "prompt tokens",
            "prefill tokens computed",
            "tokens from cache",
            "TTFT p50 ms",
            "TTFT mean ms",
            "slot caches cleared",
        ],
    )
    arms = [(f"ours, --prefix-cache {pol}", d) for pol, d in px["policies"].items()]
    if px.get("llama_server"):
        arms.append(("llama-server", px["llama_server"]["figures"]))
    for label, d in arms:
        s.rows.append(
            [
                label,
                str(px["prompt_tokens"]),
                _fig(d["computed"]),
                _fig(d["cached"]),
                _fig(d["ttft_p50_ms"]),
                _fig(d["ttft_mean_ms"]),
                _fig(d["cache_cleared"]),
            ]
        )
    lk = px["llama_over_keyed"]
    s.notes.append(
        f"llama/keyed: prefill tokens computed {_x(lk['computed'])}, TTFT p50 {_x(lk['ttft_p50_ms'])}, "
        f"TTFT mean {_x(lk['ttft_mean_ms'])}"
    )
    if px.get("llama_server_over_keyed"):
        pk = px["llama_server_over_keyed"]
        s.notes.append(
            f"llama-server/ours keyed: prefill tokens computed {_x(pk['computed'])}, "
            f"TTFT p50 {_x(pk['ttft_p50_ms'])}, TTFT mean {_x(pk['ttft_mean_ms'])}"
        )
    s.notes.append(
        "computed = the worker's Stats.prompt_tokens_computed difference (llama-server: timings.prompt_n); "
        "from cache = Σ telemetry cached_prompt_tokens (llama-server: timings.cache_n)"
    )
    return s


def lifecycle_section(lc: dict) -> Section:
    s = Section(
        f"4. Adapter lifecycle ({lc['adapters_registered']} adapters registered, rank {lc['rank']} on "
        f"{lc['pairs']} weights, {lc['file_bytes'] / MIB:.2f} MiB file each; worker {lc['device']} "
        f"{lc['dtype']})",
        ["figure", "value"],
    )
    rows = [
        ("register (upload + validate + push to worker), ms", _fig(lc["register_ms"])),
        ("register → first token served, ms", _fig(lc["register_to_first_token_ms"])),
        ("  of which first token after register returned, ms", _fig(lc["first_token_after_register_ms"])),
        ("worker cold load per adapter (LoadAdapter), ms", _fig(lc["worker_cold_load_ms"])),
        ("worker cold load, ms per MiB of file", _fig(lc["worker_cold_load_ms_per_mib"])),
        ("device bytes per adapter (A/B tensors on the model's device)", _mib(lc["device_bytes_per_adapter"])),
        (
            "worker host RSS growth per adapter (of which anonymous)",
            f"{_mib(lc['host_rss_bytes_per_adapter'])} ({_mib(lc['host_anon_bytes_per_adapter'])})",
        ),
        (
            "control-plane RSS growth per adapter (of which anonymous)",
            f"{_mib(lc['control_plane_rss_bytes_per_adapter'])} ({_mib(lc['control_plane_anon_bytes_per_adapter'])})",
        ),
        ("adapters that fit in 16 GiB (device rate)", str(lc["fit_16gib_device"] or "-")),
        ("adapters that fit in 16 GiB (host RSS rate)", str(lc["fit_16gib_host"] or "-")),
        ("adapters resident on the worker / registered", f"{lc['resident_on_worker']} / {lc['registered_total']}"),
    ]
    s.rows = [[a, b] for a, b in rows]
    s.notes.append(
        f"register→first token timed on the first {lc['timed']} adapters; memory rates from "
        f"{lc['adapters_registered']} registrations (worker RSS {lc['worker_rss_before'] / GIB:.2f} → "
        f"{lc['worker_rss_after'] / GIB:.2f} GiB)"
    )
    return s


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / MIB:.2f} MiB"


def roofline_section(rf: dict) -> Section:
    bw = rf["bandwidth"]
    s = Section(
        f"5. Roofline of a decode step (memory-bound), measured copy bandwidth {_fig(bw['gb_s'])} GB/s",
        ["figure", "bytes/step", "bound ms/step", "bound tok/s (B=1)", "achieved ms/step (B=1)", "achieved/bound"],
    )
    held = rf.get("weights", "held")
    s.rows.append(
        [
            f"ours, weights as held ({held}, {rf['dtype']} activations)",
            f"{rf['weight_bytes_per_step'] / MIB:.1f} MiB",
            fmt(rf["bound_ms"]),
            fmt(rf["bound_tok_s_b1"]),
            fmt(rf.get("achieved_ms")),
            _pct(rf.get("achieved_over_bound")),
        ]
    )
    s.rows.append(
        [
            "ours + one adapter (scenario 1's)",
            f"{(rf['weight_bytes_per_step'] + rf['adapter_bytes']) / MIB:.1f} MiB",
            fmt(rf["bound_lora_ms"]),
            fmt(1e3 / rf["bound_lora_ms"]),
            fmt(rf.get("achieved_lora_ms")),
            _pct(rf.get("achieved_over_bound_lora")),
        ]
    )
    s.rows.append(
        [
            "ours (in-process B=1 step) vs the GGUF's own tensor bytes",
            f"{rf['gguf_bytes_per_step'] / MIB:.1f} MiB",
            fmt(rf["bound_gguf_ms"]),
            fmt(rf["bound_gguf_tok_s_b1"]),
            fmt(rf.get("achieved_ms")),
            _pct(rf.get("achieved_over_bound_gguf")),
        ]
    )
    if rf.get("ours_1stream_itl_p50_ms") is not None:
        s.rows.append(
            [
                "ours, 1-stream serving (ITL p50, gRPC worker)",
                f"{rf['gguf_bytes_per_step'] / MIB:.1f} MiB",
                fmt(rf["bound_gguf_ms"]),
                fmt(rf["bound_gguf_tok_s_b1"]),
                fmt(rf["ours_1stream_itl_p50_ms"]),
                _pct(_div(rf["bound_gguf_ms"], rf["ours_1stream_itl_p50_ms"])),
            ]
        )
    if rf.get("llama_server_1stream_per_token_ms") is not None:
        s.rows.append(
            [
                "llama-server, 1-stream (timings.predicted_per_token_ms)",
                f"{rf['gguf_bytes_per_step'] / MIB:.1f} MiB",
                fmt(rf["bound_gguf_ms"]),
                fmt(rf["bound_gguf_tok_s_b1"]),
                fmt(rf["llama_server_1stream_per_token_ms"]),
                _pct(rf.get("llama_server_over_bound_gguf")),
            ]
        )
    s.notes.append(
        f"weights held by the model: {rf['weight_bytes_held'] / MIB:.1f} MiB vs the GGUF's tensor bytes "
        f"{rf['gguf_tensor_bytes'] / MIB:.1f} MiB = {_x(rf['held_over_gguf'])} (target ≤ 1.50×)"
        + (
            f"; worker process RSS after loading (no adapters) {rf['worker_rss_bytes'] / MIB:.0f} MiB "
            f"(anonymous {rf['worker_rss_anon_bytes'] / MIB:.0f} MiB)"
            if rf.get("worker_rss_bytes")
            else ""
        )
    )
    s.notes.append(
        "achieved/bound = bound step time / achieved step time (1.0 = at the roofline); the in-process step "
        "computes logits for the row but does no sampling; the 1-stream serving figures include "
        "sampling and the transport"
    )
    return s


def _div(a, b):
    try:
        return a / b if b else None
    except TypeError:
        return None


def _pct(r: float | None) -> str:
    return "-" if r is None or not math.isfinite(r) else f"{r:.2f}"


def paging_section(d: dict) -> Section:
    """Scenario 6: the many-adapters run beside the all-fit run."""

    def n(x, f="{:.1f}"):
        return "-" if x is None else f.format(x)

    sec = Section(
        f"6. adapter paging: {d['adapters']} adapters ({d['disk_mib']:.0f} MiB F16 on disk, ranks "
        f"{'/'.join(map(str, d['ranks']))}, attention) vs {d['fit_adapters']} that fit; --max-loras {d['max_loras']} "
        f"--max-cpu-loras {d['max_cpu_loras']} --prefix-cache {d.get('prefix_cache', 'keyed')}; "
        f"{d['streams']} streams × {d['requests']} requests × "
        f"{d['max_tokens']} tokens, Zipf(1.0)",
        [
            "run",
            "tok/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "page-ins/req",
            "evictions/req",
            "fetches/req",
            "cold TTFT p50 ms",
            "resident TTFT p50 ms",
            "worker RSS MiB: registered → served (anon)",
            "CP KiB/registration",
        ],
    )
    for label in ("ten", "fit", "many"):
        if label not in d:
            continue
        r = d[label]
        by = r.get("ttft_by_source_ms", {})
        cold = by.get("fetched") or by.get("loaded")
        sec.rows.append(
            [
                f"{label} ({r.get('registered', '?')})",
                n(r["tok_s"]),
                n(r["ttft_p50_ms"], "{:.0f}"),
                n(r["ttft_p99_ms"], "{:.0f}"),
                n(r["page_ins_per_request"], "{:.2f}"),
                n(r["evictions_per_request"], "{:.2f}"),
                n(r["fetches_per_request"], "{:.2f}"),
                n(cold and cold["p50"], "{:.0f}"),
                n(by.get("resident", {}).get("p50"), "{:.0f}"),
                f"{r['worker_rss_registered_mib']:.0f} → {r['worker_rss_mib']:.0f} ({r['worker_rss_anon_mib']:.0f})",
                n(r.get("cp_rss_per_registration_kib")),
            ]
        )
    sec.notes.append(
        f"tok/s many/fit = {n(d['tok_s_ratio_many_over_fit'], '{:.2f}')} (target ≥ 0.80); worker RSS "
        f"after the same traffic, many/ten registered = {d['worker_rss_ratio_all_over_10']:.2f} (target ≤ 1.10); "
        f"register → first token for an adapter no worker holds: "
        f"{d['many'].get('register_to_first_token_ms', 0):.0f} ms"
    )
    sec.notes.append(
        "RSS grows while serving: the keyed prefix cache keeps KV up to --prefix-cache-tokens "
        "(entries after the traffic: "
        + ", ".join(f"{k} {d[k].get('prefix_cache_entries', '?')}" for k in ("ten", "fit", "many") if k in d)
        + "); registrations and the host tier (file-backed) add nothing"
    )
    return sec


def _ok_of(d: dict) -> str:
    """``ok/sent`` requests over all repetitions of one arm."""
    return f"{d.get('ok', 0)}/{d.get('requests', 0) * d.get('runs', 0)}"


def longprompt_section(lp: dict) -> list[Section]:
    """Scenario 7: long distinct prompts, ours beside llama-server."""
    s = Section(
        f"7. Long prompts: {lp['streams']} closed-loop streams, {lp['requests']} requests per run × "
        f"{lp['reps']} runs, distinct {lp['prompt_tokens']}-token prompts (no shared prefix) → "
        f"{lp['max_tokens']} output tokens (greedy, ignore_eos), {lp['slots']} slots",
        [
            "workload",
            "server",
            "output tok/s",
            "prompt tok/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "ITL p50 ms",
            "ITL p99 ms",
            "prompt tokens computed / run",
            "requests ok/sent",
            "errors",
        ],
    )
    for key in lp["workloads"]:
        for who, d in lp["servers"].items():
            r = d[key]
            s.rows.append(
                [
                    key,
                    who,
                    _fig(r["tok_s"]),
                    _fig(r["prompt_tok_s"]),
                    _fig(r["ttft_p50_ms"]),
                    _fig(r["ttft_p99_ms"]),
                    _fig(r["itl_p50_ms"]),
                    _fig(r["itl_p99_ms"]),
                    _fig(r["computed"]),
                    _ok_of(r),
                    str(r["n_errors"]),
                ]
            )
    s.notes.append(
        "prompt tok/s = prompt tokens of the finished requests / the run's wall time (first submit → last "
        "token); computed = the worker's Stats.prompt_tokens_computed difference (llama-server: Σ "
        f"timings.prompt_n), {lp['requests'] * lp['prompt_tokens']:,} sent per run; K>0: Zipf(1.0) over K "
        "rank-8 adapters; ours: --batching mixed --prefix-cache keyed"
    )
    out = [s]
    if lp.get("ours_over_llama_server"):
        r = Section(
            "7b. Long prompts, ours/llama-server (medians)",
            ["workload", "output tok/s", "prompt tok/s", "TTFT p50", "ITL p50"],
        )
        for key, x in lp["ours_over_llama_server"].items():
            r.rows.append([key, _x(x["tok_s"]), _x(x["prompt_tok_s"]), _x(x["ttft_p50_ms"]), _x(x["itl_p50_ms"])])
        out.append(r)
    return out


def longctx_section(lc: dict) -> Section:
    """Scenario 8: decode ITL at a long vs a short context."""
    s = Section(
        f"8. Long-context decode: 1 stream, {lc['requests']} request(s) per context per run × {lc['reps']} runs, "
        f"{lc['max_tokens']} output tokens after a {lc['long_tokens']}- or {lc['short_tokens']}-token prompt",
        [
            "server",
            f"ITL p50 ms @{lc['long_tokens']}",
            f"ITL p50 ms @{lc['short_tokens']}",
            "ITL long/short",
            f"ITL p99 ms @{lc['long_tokens']}",
            f"TTFT p50 ms @{lc['long_tokens']}",
            "per-token ms (server's own) long / short",
            "requests ok/sent",
        ],
    )
    for who, d in lc["servers"].items():
        lo, sh = d["long"], d["short"]
        own = f"{_fig(lo['per_token_ms'])} / {_fig(sh['per_token_ms'])}" if "per_token_ms" in lo else "-"
        s.rows.append(
            [
                who,
                _fig(lo["itl_p50_ms"]),
                _fig(sh["itl_p50_ms"]),
                _x(lc["long_over_short"].get(who)),
                _fig(lo["itl_p99_ms"]),
                _fig(lo["ttft_p50_ms"]),
                own,
                f"{_ok_of(lo)} + {_ok_of(sh)}",
            ]
        )
    if lc.get("ours_over_llama_server"):
        o = lc["ours_over_llama_server"]
        s.notes.append(
            f"ours/llama-server ITL p50: {_x(o['long'])} at {lc['long_tokens']} tokens, {_x(o['short'])} at "
            f"{lc['short_tokens']} (below 1: ours faster)"
        )
    s.notes.append(
        "ITL = gaps between successive output tokens at the client (the prompt's time is the TTFT, not in it)"
    )
    return s


def bounds_section(bd: dict) -> Section:
    """Scenario 9: peak int8 MAC rates, the B=16 step's compute and memory bounds, the step."""
    s = Section(
        f"9. Bounds of a B={bd['batch']} decode step on {bd['threads']} threads: "
        f"{bd['macs_per_step'] / 1e9:.2f} GMAC ({bd['linear_weights']} linear weights + LM head "
        f"{bd['lm_head']}, × {bd['batch']} rows)",
        ["figure", "rate", f"B={bd['batch']} step bound ms", "in-process step / bound"],
    )
    step_med = bd["step_ms"]["median"]
    for isa, pk in bd["peaks"].items():
        if "error" in pk:
            s.rows.append([f"peak int8, {pk['instruction']}", f"failed: {pk['error']}", "-", "-"])
            continue
        s.rows.append(
            [
                f"peak int8, {pk['instruction']}" + (" (fastest)" if isa == bd["fastest"] else ""),
                f"{_fig(pk['gmac_s'])} GMAC/s",
                fmt(pk["compute_bound_ms"]),
                _x(_div(step_med, pk["compute_bound_ms"])),
            ]
        )
    bw = bd["bandwidth"]["gb_s"]
    s.rows.append(
        [
            f"memory, the GGUF's tensor bytes ({bd['gguf_bytes_per_step'] / MIB:.1f} MiB/step)",
            f"{_fig(bw)} GB/s copy",
            fmt(bd["memory_bound_ms"]),
            _x(_div(step_med, bd["memory_bound_ms"])),
        ]
    )
    s.rows.append(
        [
            f"memory, the bytes our model holds ({bd['weight_bytes_per_step'] / MIB:.1f} MiB/step, {bd['weights']})",
            f"{_fig(bw)} GB/s copy",
            fmt(bd["memory_bound_held_ms"]),
            _x(_div(step_med, bd["memory_bound_held_ms"])),
        ]
    )
    s.rows.append(
        [
            f"B={bd['batch']} bound = max(fastest compute, GGUF memory): {bd['bound_kind']}-bound",
            "",
            fmt(bd["bound_ms"]),
            f"{_x(bd['step_over_bound'])} (target ≤ {bd['target_step_over_bound']:.1f}×)",
        ]
    )
    s.rows.append(
        [
            f"in-process B={bd['batch']} step ({bd['weights']} weights, {bd['dtype']}, with sampling)",
            f"{_fig(bd['step_ms'])} ms",
            "",
            f"best {_x(bd['step_best_over_bound'])}",
        ]
    )
    if bd.get("paired_step_over_bound") is not None:
        s.rows.append(
            [
                "each repetition over the bound of its moment (bandwidth measured just before it)",
                f"bound {_fig(bd['paired_bound_ms'])} ms",
                "",
                f"{_fig(bd['paired_step_over_bound'])}×",
            ]
        )
    if bd.get("served_step_ms") is not None:
        s.rows.append(
            [
                "worker's decode step interval (serving, mixed)",
                f"{fmt(bd['served_step_ms'])} ms",
                "",
                _x(bd["served_step_over_bound"]),
            ]
        )
    s.notes.append(
        "peak rates: bench/csrc/peak_int8.cpp, register-resident independent chains of one instruction per thread; "
        "bounds use the best repetition of each rate (the rate column: median, min–max); attention's QK^T/PV "
        f"products are not counted ({bd['decode_ctx']} tokens of context); our kernels multiply int16 activations "
        "(vpdpwssd, half vpdpbusd's MACs per instruction) by default"
    )
    return s


def step_section(d: dict) -> Section:
    """Table 1b: `bench.device_step.run_device_step`'s results."""
    s = Section(
        f"1b. Decode step vs its memory bound, {d['model']}, dtype {d['dtype']}, {d['device']}"
        + (f" ({d['gpu']})" if d.get("gpu") else ""),
        [
            "B",
            "adapters",
            "step (ms)",
            "tok/s",
            "bound (ms)",
            "step / bound",
            "host (ms/step)",
            "kernels / step",
            "launches / step",
            "GPU busy (ms, % of step)",
        ],
    )
    for r in d["rows"]:
        pr = r.get("profile") or {}
        busy = f"{fmt(pr['busy_ms'])} ({100 * pr['busy_frac']:.0f} %)" if pr else "-"
        s.rows.append(
            [
                str(r["batch"]),
                r["mix"],
                _fig(r["step_ms"]),
                _fig(r["tok_s"]),
                fmt(r["bound_ms"]),
                f"{r['step_over_bound']:.1f}×",
                _fig(r["host_ms"]),
                str(pr["kernels"]) if pr else "-",
                f"{pr['launches']} ({pr['graph_launches']} graphs)" if pr else "-",
                busy,
            ]
        )
    bw = d["bandwidth"]
    s.notes.append(
        "bound = (W + KV + A) / copy rate; W = weights a step reads (held form, LM head included) = "
        f"{d['weight_bytes_per_step'] / MIB:,.1f} MiB; KV = B × L × n_layer × n_head_kv × (dk + dv) × elem = "
        f"B × {d['attended_positions']:g} positions × {d['kv_bytes_per_position'] / 1024:,.1f} KiB; "
        f"A = distinct adapters' A/B bytes, {d['adapter_bytes'] / MIB:,.1f} MiB each (rank {d['adapter_rank']}); "
        f"copy rate = read + write bytes of a {bw['tensor_mib']} MiB device-to-device copy_ / time = "
        f"{_fig(bw['gb_s'])} GB/s"
    )
    s.notes.append(
        f"{d['decode_steps']} decode steps per repetition from {d['decode_ctx']} tokens of context; host = "
        "thread_time of the step thread around decode (includes spinning on a device sync inside it); kernels, "
        "launches (host launch calls; a CUDA graph replay is one) and GPU busy (union of device activity in one "
        "profiled step, over the median step) on CUDA only"
    )
    return s


BUILDERS = {
    "engine": lambda d: [engine_section(d)],
    "step": lambda d: [step_section(d)],
    "serving": serving_sections,
    "prefix": lambda d: [prefix_section(d)],
    "lifecycle": lambda d: [lifecycle_section(d)],
    "roofline": lambda d: [roofline_section(d)],
    "paging": lambda d: [paging_section(d)],
    "longprompt": longprompt_section,
    "longctx": lambda d: [longctx_section(d)],
    "bounds": lambda d: [bounds_section(d)],
}


def sections_for(key: str, d: dict, machine: dict | None = None) -> list[Section]:
    """The table(s) of one scenario's results (one FAILED row when it raised); with
    ``machine`` (the JSON's section) each table's notes name the CPU, its flags, the kernels
    and the OpenMP wait policy."""
    if "error" in d:
        return [Section(f"{key}: FAILED", ["error"], [[d["error"]]])]
    out = BUILDERS[key](d)
    if "load_avg" in d:
        out[-1].notes.append(
            f"machine load average (1/5/15 min): {d['load_avg']['before']} before, {d['load_avg']['after']} after"
        )
    if machine:
        from bench.machine import machine_line

        for sec in out:
            sec.notes.append(machine_line(machine))
    return out


def sections(result: dict) -> list[Section]:
    """All tables, in scenario order."""
    out = []
    for key in BUILDERS:
        d = result["scenarios"].get(key)
        if d is not None:
            out += sections_for(key, d, result.get("machine"))
    return out


def header_lines(result: dict) -> list[str]:
    m, p = result["machine"], result["params"]
    return [
        f"loraplane bench — profile {result['profile']}, {p['reps']} repetition(s) per figure (median [min–max]), "
        f"seed {result['seed']}",
        f"machine: {m['cpus']} CPUs, torch {m['torch']} ({m['torch_threads']} threads), python {m['python']}, "
        f"load average at start {m['load_avg_start']}, at end {m.get('load_avg_end', '-')}; "
        f"OMP_WAIT_POLICY={p.get('omp_wait_policy') or '(unset)'}",
        f"CPU: {m.get('cpu_model', '?')}; flags: {' '.join(m.get('cpu_flags', [])) or '-'}"
        f" (absent: {' '.join(m.get('cpu_flags_missing', [])) or 'none'}); "
        f"matmuls: {(m.get('kernels') or {}).get('summary', '?')}; activation dtype {p.get('dtype', '?')}, "
        f"weights {p.get('weights', '?')}",
        f"command: {result['command']}",
    ]


def render_markdown(result: dict) -> str:
    buf = io.StringIO()
    for line in header_lines(result):
        buf.write(f"{line}  \n")
    buf.write("\n")
    for s in sections(result):
        buf.write(f"#### {s.title}\n\n")
        buf.write("| " + " | ".join(s.columns) + " |\n")
        buf.write("|" + "|".join("---" for _ in s.columns) + "|\n")
        for row in s.rows:
            buf.write("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |\n")
        for n in s.notes:
            buf.write(f"\n{n}\n")
        buf.write("\n")
    return buf.getvalue()


def render_plain(result: dict) -> str:
    buf = io.StringIO()
    for line in header_lines(result):
        buf.write(line + "\n")
    for s in sections(result):
        buf.write(f"\n{s.title}\n")
        widths = [max(len(c), *(len(r[i]) for r in s.rows)) if s.rows else len(c) for i, c in enumerate(s.columns)]
        buf.write("  ".join(c.ljust(w) for c, w in zip(s.columns, widths, strict=False)).rstrip() + "\n")
        buf.write("  ".join("-" * w for w in widths) + "\n")
        for row in s.rows:
            buf.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() + "\n")
        for n in s.notes:
            buf.write(f"  {n}\n")
    return buf.getvalue()


def print_section(s: Section, *, use_rich: bool) -> None:
    """Print one section as it completes (rich table when available)."""
    if use_rich:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=s.title, title_justify="left", show_lines=False)
        for c in s.columns:
            t.add_column(c, overflow="fold")
        for row in s.rows:
            t.add_row(*row)
        console = Console(width=max(120, Console().width))
        console.print(t)
        for n in s.notes:
            console.print(f"  {n}", style="dim", highlight=False)
        return
    widths = [max(len(c), *(len(r[i]) for r in s.rows)) if s.rows else len(c) for i, c in enumerate(s.columns)]
    print(f"\n{s.title}")
    print("  ".join(c.ljust(w) for c, w in zip(s.columns, widths, strict=False)).rstrip())
    print("  ".join("-" * w for w in widths))
    for row in s.rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())
    for n in s.notes:
        print(f"  {n}")
