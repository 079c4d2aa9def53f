"""The benchmark harness runs end to end and reports every scenario with numbers.

No speed is asserted anywhere: the figures depend on the machine. The test runs ``--smoke``
(the profile made for it: every scenario at its smallest size) once, which exercises all nine
scenarios: engine, gRPC serving with mixed and compat workers, lifecycle, prefix reuse,
roofline, paging, long prompts, long context, bounds; about 1.5 minutes on 2 CPU cores, mostly
starting the worker processes (``--quick`` ran the same code at larger sizes in 3-6 minutes).
A second run selects one scenario with ``--only``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("engine", "serving", "prefix", "lifecycle", "roofline", "paging", "longprompt", "longctx", "bounds")


def _number(d: dict, *path: str) -> float:
    for key in path:
        assert isinstance(d, dict) and key in d, f"missing {'.'.join(path)} (at '{key}')"
        d = d[key]
    assert isinstance(d, (int, float)) and not isinstance(d, bool), f"{'.'.join(path)} = {d!r} is not a number"
    assert math.isfinite(d), f"{'.'.join(path)} = {d!r}"
    return d


def test_usage_errors_exit_2():
    from bench.__main__ import main

    assert main(["--only", "nonsense"]) == 2
    assert main(["--no-such-flag"]) == 2


def test_synthetic_adapter_is_a_valid_rank8_adapter_on_every_linear_weight(tmp_path, base_index):
    from bench.synth import AdapterFactory
    from worker.lora.adapter import load_lora_adapter

    arch, tensors = base_index
    factory = AdapterFactory(tmp_path, arch=arch, base_tensors=tensors, base_seed=7)
    path = factory.path(0)
    adapter = load_lora_adapter(path, base_arch=arch, base_tensors=tensors)
    linear = [
        n
        for n in tensors
        if n.startswith("blk.")
        and n.rsplit(".", 2)[-2] in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    ]
    assert sorted(adapter.pairs) == sorted(linear)
    assert adapter.ranks == (8,) and adapter.alpha == 16.0
    again = AdapterFactory(tmp_path / "again", arch=arch, base_tensors=tensors, base_seed=7).path(0)
    assert again.read_bytes() == path.read_bytes()  # fixed seeds: identical files


def test_workloads_are_deterministic():
    import numpy as np

    from bench.serving import workloads, zipf_choices

    assert workloads((0, 1, 4)) == [(0, "base"), (1, "single"), (4, "rr"), (4, "zipf")]
    a = zipf_choices(np.random.default_rng(1), 16, 64)
    assert a == zipf_choices(np.random.default_rng(1), 16, 64)
    assert a.count(0) > a.count(15)  # Zipf: the first adapter is the most popular


def test_bench_smoke_reports_every_scenario(tmp_path):
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LLAMA_SERVER", None)
    proc = subprocess.run(
        # passive OpenMP waits: this machine may be shared, and spinning threads collapse then
        [
            sys.executable,
            "-m",
            "clients.cli",
            "bench",
            "--json",
            str(out),
            "--smoke",
            "--plain",
            "--markdown",
            str(md),
            "--omp-wait-policy",
            "passive",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    data = json.loads(out.read_text())
    assert data["profile"] == "smoke" and data["errors"] == []
    sc = data["scenarios"]
    for key in SCENARIOS:
        assert key in sc and "error" not in sc[key], (key, sc.get(key))

    e = sc["engine"]
    for variant in ("base", "lora"):
        _number(e, "variants", variant, "pp_tok_s", "median")
        for b in ("1", "8", "16", "32"):
            _number(e, "variants", variant, "decode", b, "tok_s", "median")
            assert _number(e, "variants", variant, "decode", b, "step_sampled_ms", "median") >= _number(
                e, "variants", variant, "decode", b, "step_ms", "min"
            )
    _number(e, "lora_overhead", "decode_b1")

    m = data["machine"]
    assert m["cpu_model"] and isinstance(m["cpu_flags"], list)
    assert m["kernels"]["weights"] == "packed" and m["kernels"]["path"] in ("amx", "avx512", "avx2", "torch")
    assert data["params"]["weights"] == "packed"

    s = sc["serving"]
    assert s["single_key"] in s["workloads"] and s["single_key"] in s["modes"]["mixed"]
    _number(s, "engine_step_sampled_ms", "median")  # scenario 1's B=streams step, printed beside the loop's
    for key in s["workloads"]:
        for mode in ("mixed", "compat") if key != s["single_key"] else ("mixed",):
            run = s["modes"][mode][key]
            assert run["n_errors"] == 0, run["errors"]
            assert _number(run, "tok_s", "median") > 0
            for f in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
                _number(run, f, "median")
            if key != s["single_key"]:  # the worker's loop timing after each run (decode-only steps)
                assert _number(run, "sched_interval_p50_ms", "median") > 0
                assert _number(run, "sched_busy_p50_ms", "median") > 0
        if key != s["single_key"]:
            _number(s, "mixed_over_compat", key)

    p = sc["prefix"]
    for pol in ("keyed", "llama"):
        assert p["policies"][pol]["n_errors"] == 0
        _number(p, "policies", pol, "computed", "median")
        _number(p, "policies", pol, "ttft_p50_ms", "median")
    # the keyed cache serves the shared system prompt again; llama's clears on every switch
    assert p["policies"]["keyed"]["cached"]["median"] > 0
    assert p["policies"]["llama"]["computed"]["median"] == p["prompt_tokens"]

    lc = sc["lifecycle"]
    for f in ("register_ms", "register_to_first_token_ms", "worker_cold_load_ms", "worker_cold_load_ms_per_mib"):
        _number(lc, f, "median")
    assert _number(lc, "device_bytes_per_adapter") > 0
    _number(lc, "fit_16gib_device")

    pg = sc["paging"]
    for label in ("ten", "fit", "many"):
        assert pg[label]["n_errors"] == 0, pg[label]["errors"]
        assert _number(pg[label], "tok_s") > 0
        for f in (
            "ttft_p50_ms",
            "ttft_p99_ms",
            "page_ins_per_request",
            "fetches_per_request",
            "worker_rss_registered_mib",
            "worker_rss_mib",
            "worker_rss_anon_mib",
        ):
            _number(pg[label], f)
    assert (pg["ten"]["registered"], pg["many"]["registered"]) == (min(10, pg["adapters"]), pg["adapters"])
    _number(pg, "tok_s_ratio_many_over_fit")
    _number(pg, "worker_rss_ratio_all_over_10")
    _number(pg, "many", "register_to_first_token_ms")
    assert pg["many"]["page_ins_per_request"] > 0  # more adapters than slots: it pages

    _check_roofline(sc)
    _check_long(sc)
    _check_bounds(sc)

    text = md.read_text()
    for title in (
        "1. Engine",
        "2. Multi-tenant serving",
        "3. Prefix reuse",
        "4. Adapter lifecycle",
        "5. Roofline",
        "6. adapter paging",
        "7. Long prompts",
        "8. Long-context decode",
        "9. Bounds of a B=16 decode step",
    ):
        assert title in text


def _check_roofline(sc: dict, with_worker: bool = True) -> None:
    """Scenario 5 (the worker's RSS only when a serving scenario ran a worker)."""
    r = sc["roofline"]
    for f in (
        "bound_ms",
        "bound_gguf_ms",
        "achieved_ms",
        "achieved_over_bound",
        "achieved_over_bound_gguf",
        "weight_bytes_held",
        "gguf_tensor_bytes",
        "held_over_gguf",
    ):
        _number(r, f)
    if with_worker:
        _number(r, "worker_rss_bytes")
    _number(r, "bandwidth", "gb_s", "median")


def _check_long(sc: dict) -> None:
    """Scenarios 7 and 8 (ours only: the tests run without $LLAMA_SERVER)."""
    lp = sc["longprompt"]
    assert set(lp["servers"]) == {"ours"} and lp["workloads"] == [
        f"K={k} {'base' if k == 0 else 'zipf'}" for k in lp["ks"]
    ]
    sent = lp["requests"] * lp["prompt_tokens"]
    for key in lp["workloads"]:
        run = lp["servers"]["ours"][key]
        assert run["n_errors"] == 0 and run["ok"] == lp["requests"] * lp["reps"], run["errors"]
        for f in ("tok_s", "prompt_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
            assert _number(run, f, "median") > 0
        # distinct prompts: every prompt token is computed, except at most the shared BOS per request
        assert sent - lp["requests"] <= _number(run, "computed", "median") <= sent

    lc = sc["longctx"]
    for arm in ("long", "short"):
        run = lc["servers"]["ours"][arm]
        assert run["n_errors"] == 0 and run["ok"] == lc["requests"] * lc["reps"], run["errors"]
        assert _number(run, "itl_p50_ms", "median") > 0
    assert _number(lc, "long_over_short", "ours") > 0


def _check_bounds(sc: dict) -> None:
    """Scenario 9."""
    bd = sc["bounds"]
    assert bd["batch"] == 16 and bd["macs_per_step"] == 16 * bd["macs_per_row"]
    assert bd["fastest"] in bd["peaks"] and "error" not in bd["peaks"][bd["fastest"]]
    assert _number(bd, "peaks", bd["fastest"], "gmac_s", "median") > 0
    assert _number(bd, "bound_ms") == max(_number(bd, "compute_bound_ms"), _number(bd, "memory_bound_ms"))
    assert _number(bd, "step_ms", "median") > 0
    _number(bd, "step_over_bound")
    # one paired bound per repetition of the step, each at least the compute bound (a Figure's JSON
    # holds 6 decimals, bench.stats: on a compute-bound CPU the two are the same number, rounded)
    assert bd["paired_bound_ms"]["n"] == bd["step_ms"]["n"] == bd["paired_step_over_bound"]["n"]
    assert _number(bd, "paired_bound_ms", "min") >= round(_number(bd, "compute_bound_ms"), 6)
    assert _number(bd, "paired_step_over_bound", "min") > 0


def test_peak_int8_counts_the_macs_it_runs():
    """The peak-rate binary reports exactly iterations × chains × MACs per instruction × threads."""
    from bench.bounds import ISAS, _run_peak, available_isas, build_peak_binary

    exe = build_peak_binary()
    chains = {"amx": 4, "avx512vnni": 12, "avxvnni": 12, "avx2": 8}
    isas = available_isas()
    assert isas, "no x86 int8 instruction family listed in /proc/cpuinfo"
    checked = []
    for isa in isas:
        try:
            macs, secs = _run_peak(exe, isa, 2, 1000)
        except RuntimeError as exc:
            # a kernel/VM that lists AMX but refuses its state (arch_prctl): exit status 3, nothing else
            assert isa == "amx" and "exit status 3" in str(exc), (isa, exc)
            continue
        assert macs == 2 * 1000 * chains[isa] * ISAS[isa][1], isa
        assert secs > 0
        checked.append(isa)
    assert "avx2" in checked or "avx2" not in isas


def test_available_isas_follow_the_cpu_flags():
    from bench.bounds import available_isas

    assert available_isas(frozenset({"avx2", "fma"})) == ["avx2"]
    assert available_isas(frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"})) == ["avx512vnni", "avx2"]
    assert available_isas(frozenset({"avx2", "avx_vnni", "amx_tile", "amx_int8"})) == ["amx", "avxvnni", "avx2"]
    assert available_isas(frozenset({"amx_tile"})) == []


def test_step_macs_count_every_linear_weight_and_the_tied_head():
    from types import SimpleNamespace

    from bench.bounds import step_macs

    ne = {
        "token_embd.weight": (8, 100),
        "blk.0.attn_q.weight": (8, 16),
        "blk.0.attn_norm.weight": (8,),
        "blk.0.ffn_down.weight": (32, 8),
    }
    m = step_macs(SimpleNamespace(tensor_ne=ne), 16)
    assert (m["lm_head"], m["linear_weights"], m["macs_per_row"]) == ("token_embd.weight", 2, 800 + 128 + 256)
    assert m["macs_per_step"] == 16 * 1184
    untied = step_macs(SimpleNamespace(tensor_ne={**ne, "output.weight": (8, 50)}), 1)
    assert (untied["lm_head"], untied["macs_per_row"]) == ("output.weight", 400 + 128 + 256)


def test_bench_only_runs_the_selected_scenarios(tmp_path):
    """``--smoke --only 5,bounds`` (a number and a name): scenarios 5 and 9 alone (in-process,
    no worker), nothing else reported or printed."""
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LLAMA_SERVER", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--smoke",
            "--only",
            "5,bounds",
            "--plain",
            "--json",
            str(out),
            "--omp-wait-policy",
            "passive",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    data = json.loads(out.read_text())
    assert data["errors"] == [] and data["selected"] == ["roofline", "bounds"]
    assert sorted(data["scenarios"]) == ["bounds", "roofline"]
    _check_roofline(data["scenarios"], with_worker=False)
    _check_bounds(data["scenarios"])
    assert "5. Roofline" in proc.stdout and "9. Bounds" in proc.stdout
    assert "1. Engine" not in proc.stdout and "7. Long prompts" not in proc.stdout
